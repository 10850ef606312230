"""Glue between hf_fpdt's algorithm and the Hugging Face stack (no algorithm code lives here)."""
