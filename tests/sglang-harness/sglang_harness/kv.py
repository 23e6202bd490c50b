"""The KV pool, its page allocator and the KV manager of one worker.

The pool is SGLang's own `MHATokenToKVPool` on the CPU; the KV manager is built from it exactly
as `PrefillBootstrapQueue._init_kv_manager` (srt/disaggregation/prefill.py) and
`DecodePreallocQueue._init_kv_manager` (srt/disaggregation/decode.py) build theirs, with the
same helpers (`get_kv_transfer_buf_infos`, `setup_state_kv_args`, `MetadataBuffers`, ...).

Played here: the page allocator (SGLang's `token_to_kv_pool_allocator`; a free list of pages),
and the "model" that writes KV: a deterministic value per (room, position, layer, K/V, head,
dim), so decode can check what landed byte for byte.
"""

import hashlib
from typing import List, Optional, Tuple

import numpy as np
import torch

from . import model_dir

KV_DTYPE = torch.bfloat16


class PagePool:
    """The KV pool (SGLang's MHATokenToKVPool) and a free list of its pages. Page 0 holds
    SGLang's padding slot and is never handed out."""

    def __init__(self, num_pages: int, page_size: int):
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        self.page_size = page_size
        self.num_pages = num_pages
        self.pool = MHATokenToKVPool(
            size=num_pages * page_size,
            page_size=page_size,
            dtype=KV_DTYPE,
            head_num=model_dir.NUM_KV_HEADS,
            head_dim=model_dir.HEAD_DIM,
            layer_num=model_dir.NUM_LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        self._free = list(range(1, num_pages + 1))

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def available_pages(self) -> int:
        return len(self._free)

    def alloc(self, num_tokens: int) -> Optional[np.ndarray]:
        """Pages for `num_tokens` tokens, or None when the pool cannot hold them."""
        n = max(1, -(-num_tokens // self.page_size))
        if n > len(self._free):
            return None
        pages, self._free = self._free[:n], self._free[n:]
        return np.asarray(pages, dtype=np.int32)

    def free(self, pages: Optional[np.ndarray]) -> None:
        if pages is not None:
            self._free.extend(int(p) for p in pages)

    def _slots(self, pages: np.ndarray, num_tokens: int) -> torch.Tensor:
        slots = (
            torch.as_tensor(pages, dtype=torch.int64)[:, None] * self.page_size
            + torch.arange(self.page_size)[None, :]
        ).reshape(-1)
        return slots[:num_tokens]

    def _buffers(self) -> List[Tuple[int, int, torch.Tensor]]:
        out = []
        for layer in range(model_dir.NUM_LAYERS):
            out.append((layer, 0, self.pool.k_buffer[layer]))
            out.append((layer, 1, self.pool.v_buffer[layer]))
        return out

    @staticmethod
    def pattern(room: int, num_tokens: int, layer: int, kv: int) -> torch.Tensor:
        """What the played forward writes: small integers (exact in bfloat16) that differ per
        room, position, layer, K/V, head and dim."""
        pos = torch.arange(num_tokens, dtype=torch.int64)[:, None, None]
        head = torch.arange(model_dir.NUM_KV_HEADS, dtype=torch.int64)[None, :, None]
        dim = torch.arange(model_dir.HEAD_DIM, dtype=torch.int64)[None, None, :]
        v = (room % 65521) * 131 + pos * 17 + layer * 7 + kv * 5 + head * 3 + dim
        return (v % 251).to(KV_DTYPE)

    def fill(self, room: int, pages: np.ndarray, num_tokens: int) -> None:
        """The played model forward: write this request's KV into its pages."""
        slots = self._slots(pages, num_tokens)
        for layer, kv, buf in self._buffers():
            buf[slots] = self.pattern(room, num_tokens, layer, kv)

    def digest(self, pages: np.ndarray, num_tokens: int) -> str:
        """sha256 over the request's KV bytes, position-major per (layer, K/V) buffer."""
        slots = self._slots(pages, num_tokens)
        h = hashlib.sha256()
        for _, _, buf in self._buffers():
            h.update(buf[slots].contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def matches_pattern(self, room: int, pages: np.ndarray, num_tokens: int) -> bool:
        slots = self._slots(pages, num_tokens)
        return all(
            torch.equal(buf[slots], self.pattern(room, num_tokens, layer, kv))
            for layer, kv, buf in self._buffers()
        )

    def clear(self, pages: np.ndarray) -> None:
        """Zero freed pages on decode, so a later room's check cannot pass on stale bytes."""
        slots = self._slots(pages, len(pages) * self.page_size)
        for _, _, buf in self._buffers():
            buf[slots] = 0


def build_kv_manager(mode, server_args, page_pool: PagePool, metadata_buffers, tp_rank: int):
    """`_init_kv_manager` of prefill.py / decode.py for an MHA pool without draft model, on
    the mooncake backend."""
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        build_kv_layer_ids,
        get_kv_class,
        get_kv_transfer_buf_infos,
        get_pd_kv_layout,
        is_mla_backend,
        setup_state_kv_args,
    )
    from sglang.srt.runtime_context import get_device, get_disagg, get_model, get_parallel

    pool = page_pool.pool
    backend = TransferBackend(get_disagg().disaggregation_transfer_backend)
    kv_args = get_kv_class(backend, KVClassType.KVARGS)()
    if mode == DisaggregationMode.PREFILL:
        kv_args.engine_rank = tp_rank
    else:
        kv_args.engine_rank = tp_rank % get_parallel().attn_tp_size
    kv_args.pp_rank = get_parallel().pp_rank
    kv_args.system_dp_rank = get_parallel().dp_rank
    if mode == DisaggregationMode.PREFILL:
        kv_args.rust_http_port = None
    # ModelRunner.kv_cache_dtype_str: the unquantized pool reports the server arg ("auto").
    kv_args.kv_cache_dtype_str = get_model().kv_cache_dtype
    kv_args.kv_layout = get_pd_kv_layout(pool)
    if mode == DisaggregationMode.PREFILL:
        kv_args.prefill_start_layer = pool.start_layer
    kv_data_ptrs, kv_data_lens, kv_item_lens = get_kv_transfer_buf_infos(pool)
    if mode == DisaggregationMode.PREFILL:
        kv_args.prefill_end_layer = getattr(pool, "end_layer", None)
    kv_args.kv_data_ptrs = kv_data_ptrs
    kv_args.kv_data_lens = kv_data_lens
    kv_args.kv_item_lens = kv_item_lens
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = build_kv_layer_ids(
        token_to_kv_pool=pool,
        draft_token_to_kv_pool=None,
        num_draft_entries=0,
        num_hidden_layers=model_dir.NUM_LAYERS,
    )
    mla = is_mla_backend(pool)
    if mode == DisaggregationMode.PREFILL and not mla:
        kv_args.kv_head_num = pool.head_num
        kv_args.total_kv_head_num = model_dir.NUM_KV_HEADS
    kv_args.page_size = pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = (
        metadata_buffers.get_buf_infos()
    )
    setup_state_kv_args(
        kv_args,
        pool,
        None,
        model_dir.NUM_LAYERS,
        req_to_token_pool=None,
    )
    kv_args.ib_device = get_disagg().disaggregation_ib_device
    kv_args.gpu_id = get_device().gpu_id
    manager_class = get_kv_class(backend, KVClassType.MANAGER)
    return manager_class(kv_args, mode, server_args, mla)
