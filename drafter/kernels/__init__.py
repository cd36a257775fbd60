"""Every Triton kernel, and the timing that picks their tile shapes.

    paged_attention.py  paged attention (first pass, decode, tree) behind attention.triton_backend
    kv_write.py         KV writes with rotary embedding
    step_inputs.py      a draft step's positions, slots and sequence lengths on the device
    batch_inputs.py     the captured graphs' input loader (one header, the call's tensors in place)
    draft_output.py     the drafts out of the graphs
    fused_kernels.py    RMSNorm and fused norm / argmax parts
    skinny_gemm.py      GEMMs for the few rows of a draft step;  weight_gemm.py: tile choice per weight
    cuda_timing.py      device time of short GPU work by CUDA-graph replay
    mla_attention.py, latent_write.py, fp8_gemm.py   DeepSeek-V3 MTP: MLA attention, latent KV writes, FP8 GEMMs
Every kernel reads its sizes from tensor shapes and device tensors only, never from host copies
of tensor values, so a draft loop built from them can be captured in a CUDA graph.  Kernels import
nothing above them (drafter.wire records, drafter.attention.metadata at most).
"""
