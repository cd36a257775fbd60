"""Triton kernels (see /work/notes/17-plan.md: every Triton kernel lives here)."""
