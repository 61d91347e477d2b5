"""Mell (Fig. 10 packer and its epoch scheduler)."""
