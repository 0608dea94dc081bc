"""mxserve.cluster"""
