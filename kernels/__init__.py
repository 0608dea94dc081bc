"""mxserve.kernels"""
