"""edgevlm.runtime"""
