"""mxserve.worker"""
