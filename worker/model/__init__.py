"""mxserve.worker.model"""
