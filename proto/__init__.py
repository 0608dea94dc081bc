"""mxserve.proto"""
