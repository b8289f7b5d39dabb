"""edgevlm.daemon"""
