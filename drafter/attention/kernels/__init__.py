"""Triton kernels behind TritonBackend: paged attention (first pass, decode, tree), KV writes
with rotary embedding, and the index kernels that prepare a draft step's inputs.

Every kernel reads its sizes from tensor shapes and device tensors only, never from host
copies of tensor values, so a draft loop built from them can be captured in a CUDA graph.
"""
