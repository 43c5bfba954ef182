"""dvi_lite: speculative decoding from speculative sampling to DVI, on a small course model."""
__version__ = "0.1.0"
