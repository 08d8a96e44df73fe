"""Multimodal inputs: media fetching (media.py, media_security.py)."""
