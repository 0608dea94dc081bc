"""mxserve.router"""
