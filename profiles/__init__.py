"""Shipped device profiles (YAML files), installed as package data of ``edgevlm.profiles``.

Validated by :class:`edgevlm.profile.Profile`; see :func:`edgevlm.profile.load_profile`.
"""
