"""edgevlm.quantize"""
