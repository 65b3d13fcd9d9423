"""Hugging Face transformers as the runner's oracle: random weights at the runner's scales on a transformers model
(its own init, std 0.02, leaves the logits nearly flat) and its greedy tokens, decoding with its cache."""
import torch

from dsa_triton.moe.mxfp4_reference import mxfp4_dequantize_torch, mxfp4_quantize_torch


def runner_scale(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A parameter redrawn: norms near 1, biases near 0, the embedding N(0, 1), the rest N(0, 1/fan_in); experts made
    MXFP4-representable (the runner's load-time conversion is then lossless)."""
    t = torch.randn(shape, generator=g)
    if name.endswith("norm.weight"):
        t = 1 + 0.1 * t
    elif name.endswith("bias"):
        t = 0.1 * t
    elif "embed_tokens" not in name:
        t = t * shape[-1] ** -0.5
    if ".experts." in name:
        t = mxfp4_dequantize_torch(*mxfp4_quantize_torch(t))
    return t


def randomize(model, g: torch.Generator, draw=runner_scale) -> None:
    """Redraw a transformers model's parameters (``draw(name, shape, g)``) and its routers' correction biases
    (N(0, 0.01)) in place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(draw(name, p.shape, g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, decoding with transformers' cache."""
    out, ids, cache = [], torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(n):
            result = model(input_ids=ids, cache=cache, use_cache=True)
            cache = result.cache
            out.append(int(result.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out
