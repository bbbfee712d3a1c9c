# Type stub for the compiled CPU forward (csrc/cpu_forward.cpp, built by setup.py when a
# compiler is present; absent otherwise, and pagedecode falls back to the torch path).
import torch

def forward(
    ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, cu_q: torch.Tensor, logits_indices: torch.Tensor, embed: torch.Tensor,
    final_norm: torch.Tensor, lm_head: torch.Tensor, lm_head_t: torch.Tensor, lm_head_packed: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor, layers: list[torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float, onednn: bool = ..., deterministic: bool = ...,
) -> torch.Tensor: ...

def det_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor: ...

def det_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...

def silu_mul(gate_up: torch.Tensor) -> torch.Tensor: ...

def det_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, page_table: torch.Tensor,
                  seq_lens: torch.Tensor, cu_q: torch.Tensor, scale: float) -> torch.Tensor: ...

def keep_freed_memory() -> bool: ...

def quant_linear(x: torch.Tensor, blocks: torch.Tensor, n_out: int) -> torch.Tensor: ...

def quant_embedding_rows(blocks: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor: ...
