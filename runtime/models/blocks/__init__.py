"""Shared model blocks the families are built from (the SigLIP vision tower: :mod:`.siglip`)."""
