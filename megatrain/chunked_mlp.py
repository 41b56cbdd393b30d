"""Token-chunked recompute of a decoder layer's token-wise parts (norm + MLP + residual, input norm).

At long sequences the MLP intermediates dominate a layer's autograd working set: gate, up, act(gate) and
their product are t x f each (7B shape at 512K tokens: 512K x 18944 x 2 B = 20 GB *each*), and the RMSNorms
keep fp32 copies of t x h. These parts are token-wise, so they can run chunk by chunk along the tokens.

``TokenwiseCheckpoint`` runs ``fn`` (a token-wise function of x and of some parameters) in chunks of
``chunk`` tokens. Forward: no autograd inside, output written chunk by chunk, only ``x`` is saved.
Backward: each chunk is recomputed with autograd and differentiated at once, so at most one chunk's
intermediates exist; parameter gradients are accumulated over chunks (in fp32 when the parameters are of a
lower precision, so 64 chunks of bf16 partial sums do not lose bits that one unchunked matmul - which
accumulates in fp32 - would keep).

Cost: the chunked part is computed once more in backward than without chunking (its forward under
autograd saves nothing to reuse). For the MLP that is 2 * P_mlp * t extra FLOPs per layer: ~14% of a 7B
layer's step FLOPs at 32K tokens, ~1% at 512K where attention (quadratic) dominates; hence "auto" chunks
only above ``AUTO_MIN_TOKENS``, and on a GPU only where the placement plan needs it (below).
"""
from __future__ import annotations

import torch

# EngineConfig.mlp_chunk_tokens = 0 ("auto"), the threshold rule: chunk only when a micro-batch has more
# than AUTO_MIN_TOKENS tokens, in chunks of AUTO_CHUNK_TOKENS. Below it the unchunked intermediates (7B
# shape, 128K tokens: 4 x 128K x 18944 x 2 B = 20 GB) fit the GPU and the extra recompute and smaller GEMMs
# cost more than they save: measured on the H200 (2026-12-01), chunking at 8K from 32K tokens took the 3B
# shape at 64K tokens/step from ~330 to 276 TFLOPS.
# Above it the rule alone chunks whether memory needs it or not, and that costs too: on the H200 (commit
# 34edccb) the 3B shape at 158x1024 tokens per step (one micro-batch) ran chunked at 291.6 TFLOPS with the
# whole model on the GPU tier and ~40 GiB to spare, against 347.6 at 128K unchunked and 335.3 for plain
# all-on-GPU PyTorch at 158x1024. So on a GPU "auto" above the threshold is the placement plan's decision
# (megatrain/planner.py): unchunked when that plan fits and places everything as the chunked one does.
# That rule has NOT yet been measured on a GPU. On the CPU (tests) the threshold rule stands.
AUTO_MIN_TOKENS = 131072
AUTO_CHUNK_TOKENS = 16384


def resolve_chunk(mlp_chunk_tokens: int, tokens: int) -> int:
    """Chunk size to use for ``tokens`` tokens per micro-batch; 0 = do not chunk (one chunk would hold
    every token: the unchunked path computes the same, bit for bit, and without the extra recompute).

    ``mlp_chunk_tokens``: -1 never, 0 auto (the threshold rule, see AUTO_MIN_TOKENS; the engine passes the
    placement plan's resolved value instead), N a chunk of N tokens."""
    if mlp_chunk_tokens < 0:
        return 0
    if mlp_chunk_tokens == 0:
        return AUTO_CHUNK_TOKENS if tokens > AUTO_MIN_TOKENS else 0
    return mlp_chunk_tokens if tokens > mlp_chunk_tokens else 0


class TokenwiseCheckpoint(torch.autograd.Function):
    """y = fn(x) computed and differentiated in chunks of rows of x viewed as [tokens, hidden].

    ``params`` must be exactly the parameters ``fn`` uses (the same tensor objects): they are inputs of the
    Function so that autograd returns their gradients to whoever asks (the engine calls
    ``torch.autograd.grad(out, [x, *params])``)."""

    @staticmethod
    def forward(ctx, fn, chunk: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.chunk = fn, chunk
        # The backward recomputes ``fn`` under the autocast state the forward ran in (EngineConfig
        # mixed_precision "autocast", megatrain/compute_policy.py): autograd runs backward outside autocast.
        dev = x.device.type
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.save_for_backward(x, *params)
        flat = x.reshape(-1, x.shape[-1])
        out = None
        for s in range(0, flat.shape[0], chunk):
            y = fn(flat[s:s + chunk])
            if out is None:  # the output's shape/dtype are fn's, known after the first chunk
                out = torch.empty((flat.shape[0], *y.shape[1:]), dtype=y.dtype, device=y.device)
            out[s:s + chunk] = y
        return out.view(*x.shape[:-1], *out.shape[1:])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *params = ctx.saved_tensors
        fn, chunk = ctx.fn, ctx.chunk
        flat = x.detach().reshape(-1, x.shape[-1])
        g_flat = grad_out.reshape(flat.shape[0], -1)
        dx = torch.empty_like(flat) if ctx.needs_input_grad[2] else None
        want = [p for p, need in zip(params, ctx.needs_input_grad[3:]) if need]
        acc = [torch.zeros_like(p, dtype=torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype)
               for p in want]
        dev, enabled, dtype = ctx.autocast
        for s in range(0, flat.shape[0], chunk):
            with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                xc = flat[s:s + chunk].detach().requires_grad_(dx is not None)
                y = fn(xc)
            inputs = ([xc] if dx is not None else []) + want
            grads = torch.autograd.grad(y, inputs, g_flat[s:s + chunk], allow_unused=True)
            if dx is not None:
                dx[s:s + chunk] = grads[0]
                grads = grads[1:]
            for a, g in zip(acc, grads):
                if g is not None:
                    a.add_(g)
            del y, grads  # this chunk's graph and intermediates are freed before the next chunk
        it = iter(a.to(p.dtype) for a, p in zip(acc, want))
        dparams = [next(it) if need else None for need in ctx.needs_input_grad[3:]]
        return (None, None, None if dx is None else dx.view(x.shape), *dparams)


def tokenwise_checkpoint(fn, chunk: int, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """``fn(x)`` in chunks of ``chunk`` tokens with only ``x`` kept for backward (see module doc). Under
    no_grad (the engine's forward) it simply runs chunk by chunk and records nothing."""
    return TokenwiseCheckpoint.apply(fn, chunk, x, *params)
