"""The decode side of the played scheduler: `DecodePreallocQueue`, `DecodeTransferQueue` and
`SchedulerDisaggregationDecodeMixin` (srt/disaggregation/decode.py), with SGLang's
`MooncakeKVReceiver`s doing every handshake.

A request's life, as in decode.py:
1. `add` (DecodePreallocQueue.add): an intake reject is retired; a request over decode's KV
   capacity is refused (400) before any receiver exists; otherwise a receiver is created at
   once (`_create_receiver_and_enqueue`) and `init`-ed as soon as prefill's parallel info is
   known (`try_ensure_parallel_info`: `GET /route` on prefill's bootstrap server, then the
   `None` registration frames). Under `prefill_complete` `init` sends `BOOTSTRAP`.
2. `pop_preallocated`: a receiver that reached WaitingForInput (at once under `early`; after
   prefill's readiness `[room, "2", rank]` under `prefill_complete`) gets its pages and a
   metadata slot, and `send_metadata` publishes them to prefill.
3. `pop_transferred`: Success commits the first token from the metadata buffer
   (`_commit_transfer_to_req`); Failed answers 500 and, once an ABORT went out, holds the pages
   until prefill's ABORT_ACK or the release timeout (deferred KV release).
4. The played decode loop: the prebuilt batch streams the first token, then one token per
   step until max_new_tokens.

Aborts come from SGLang's tokenizer manager (`AbortReq`): a streamed request's when its SSE
response ends early, a non-streamed one's when its 4 s disconnect poll finds the client gone.
"""

import logging
import time
from http import HTTPStatus
from typing import List

from . import model_dir
from .truth import poll_name

logger = logging.getLogger(__name__)


class DecodeSide:
    def __init__(self, sched):
        from sglang.srt.disaggregation.utils import TransferBackend
        from sglang.srt.environ import envs
        from sglang.srt.runtime_context import get_disagg

        self.s = sched
        self.kv_manager = sched.kv_manager
        self.transfer_backend = TransferBackend(get_disagg().disaggregation_transfer_backend)
        self.policy = get_disagg().disaggregation_decode_allocation_policy
        self.queue: List = []  # DecodeRequest, preallocating
        self.pending_reqs: List = []  # DecodeRequest, prefill info not known yet
        self.transfer_queue: List = []  # DecodeRequest, destinations published
        self.waiting_queue: List = []  # Req, KV arrived
        self.running: List = []  # Req, generating
        self.deferred_releases: List = []
        self._ensure_retry_count = {}
        self._ensure_last_attempt_time = {}
        self._max_ensure_retries = 15
        self._ensure_retry_interval = 1.0
        self.enable_deferred_kv_release = (
            envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()
        )
        self.deferred_kv_release_timeout = (
            envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()
        )
        self.last_decode_step = 0.0
        self.seen_poll = {}

    def is_fully_idle(self) -> bool:
        return not (
            self.queue or self.transfer_queue or self.waiting_queue or self.running
        )

    # ---- DecodePreallocQueue ----

    def add(self, req) -> None:
        """Scheduler._add_request_to_queue: the queue's add, then the queue-entry stamp."""
        self._add(req)
        req.time_stats.set_decode_prealloc_queue_entry_time()

    def _add(self, req) -> None:
        from sglang.srt.disaggregation.decode import DecodeRequest, _bootstrap_addr
        from sglang.srt.disaggregation.utils import (
            KVClassType,
            TransferBackend,
            _is_fake_transfer,
            get_kv_class,
            is_unadmitted_reject,
        )

        if is_unadmitted_reject(req):
            self.s.retire_unadmitted_request(req)
            return
        if self._check_if_req_exceed_kv_capacity(req):
            return
        fake = _is_fake_transfer(req)
        backend = TransferBackend.FAKE if fake else self.transfer_backend
        receiver = get_kv_class(backend, KVClassType.RECEIVER)(
            mgr=self.kv_manager,
            bootstrap_addr=_bootstrap_addr(req),
            bootstrap_room=req.bootstrap_room,
        )
        req.harness_pages = None
        decode_req = DecodeRequest(req=req, kv_receiver=receiver)
        self.queue.append(decode_req)
        self.s.truth.emit(
            "receiver_created",
            rid=req.rid,
            room=req.bootstrap_room,
            backend=backend.value,
            bootstrap_addr=_bootstrap_addr(req),
            input_tokens=len(req.origin_input_ids),
        )
        if fake:
            receiver.init(0)
            return
        if self.kv_manager.prefill_info_table.get(_bootstrap_addr(req)) is not None:
            self._init_receiver(decode_req, 0)
            return
        self.pending_reqs.append(decode_req)

    def _check_if_req_exceed_kv_capacity(self, req) -> bool:
        from sglang.srt.disaggregation.utils import prepare_abort

        input_len = len(req.origin_input_ids)
        if input_len > self.s.max_total_num_tokens:
            message = (
                f"Request {req.rid} exceeds the maximum number of tokens: "
                f"{input_len} > {self.s.max_total_num_tokens}"
            )
            logger.error(message)
            prepare_abort(req, message, status_code=HTTPStatus.BAD_REQUEST)
            self.s.truth.emit("capacity_reject", rid=req.rid, room=req.bootstrap_room)
            self.s.stream_output([req])
            return True
        return False

    def _init_receiver(self, decode_req, prefill_dp_rank: int) -> None:
        decode_req.kv_receiver.init(prefill_dp_rank)
        self.s.truth.emit(
            "receiver_init",
            rid=decode_req.req.rid,
            room=decode_req.req.bootstrap_room,
            policy=self.policy,
            bootstrap_sent=self.policy == "prefill_complete",
        )
        if self.policy == "prefill_complete":
            decode_req.req.disagg_prefill_dp_rank = prefill_dp_rank

    def _resolve_pending_reqs(self) -> None:
        from sglang.srt.disaggregation.decode import _bootstrap_addr

        if not self.pending_reqs:
            return
        by_addr = {}
        for decode_req in self.pending_reqs:
            by_addr.setdefault(_bootstrap_addr(decode_req.req), []).append(decode_req)
        remaining, ready = [], []
        now = time.monotonic()
        for addr, reqs in by_addr.items():
            last = self._ensure_last_attempt_time.get(addr)
            if last is not None and now - last < self._ensure_retry_interval:
                remaining.extend(reqs)
                continue
            self._ensure_last_attempt_time[addr] = now
            if self.kv_manager.try_ensure_parallel_info(addr):
                self._ensure_retry_count.pop(addr, None)
                self._ensure_last_attempt_time.pop(addr, None)
                ready.extend(reqs)
                continue
            count = self._ensure_retry_count.get(addr, 0) + 1
            self._ensure_retry_count[addr] = count
            if count >= self._max_ensure_retries:
                logger.error(
                    f"Could not fetch prefill parallel info from {addr} after {count} attempts"
                )
                for decode_req in reqs:
                    if decode_req.kv_receiver is not None:
                        decode_req.kv_receiver.abort()
                del self._ensure_retry_count[addr]
                del self._ensure_last_attempt_time[addr]
            else:
                remaining.extend(reqs)
        self.pending_reqs = remaining
        for decode_req in ready:
            # dp_size 1: prefill_dp_rank 0 (_resolve_prefill_dp_rank).
            self._init_receiver(decode_req, 0)

    def _poll(self, decode_req) -> int:
        poll = decode_req.kv_receiver.poll()
        key = id(decode_req)
        if self.seen_poll.get(key) != poll:
            self.seen_poll[key] = poll
            self.s.truth.emit(
                "receiver_poll",
                rid=decode_req.req.rid,
                room=decode_req.req.bootstrap_room,
                status=poll_name(poll),
            )
        return poll

    def _update_handshake_waiters(self) -> None:
        from sglang.srt.disaggregation.base import KVPoll
        from sglang.srt.disaggregation.utils import prepare_abort

        for decode_req in self.queue:
            poll = self._poll(decode_req)
            if poll == KVPoll.WaitingForInput:
                if not decode_req.waiting_for_input:
                    decode_req.waiting_for_input = True
                    decode_req.req.time_stats.set_bootstrap_done_time()
            elif poll == KVPoll.Failed:
                if decode_req.req.finished_reason is not None:
                    continue
                error_message = (
                    f"Decode handshake failed for request rank=0 "
                    f"{decode_req.req.rid=} {decode_req.req.bootstrap_room=}"
                )
                try:
                    decode_req.kv_receiver.failure_exception()
                except Exception as e:
                    error_message += f" with exception {e}"
                logger.error(error_message)
                prepare_abort(
                    decode_req.req, error_message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR
                )
                self.s.truth.emit(
                    "handshake_failed",
                    rid=decode_req.req.rid,
                    room=decode_req.req.bootstrap_room,
                )

    def pop_preallocated(self) -> bool:
        from sglang.srt.disaggregation.utils import _is_fake_transfer
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.mem_cache.common import kv_to_page_indices

        import numpy as np
        import torch

        self._resolve_pending_reqs()
        self._update_handshake_waiters()
        progressed = False
        keep = []
        failed = set()
        for decode_req in self.queue:
            if isinstance(decode_req.req.finished_reason, FINISH_ABORT):
                if not getattr(decode_req.req, "finished_output", False):
                    self.s.stream_output([decode_req.req])
                decode_req.kv_receiver.clear()
                decode_req.kv_receiver = None
                failed.add(id(decode_req))
                self.seen_poll.pop(id(decode_req), None)
                progressed = True
        if failed:
            self.pending_reqs = [r for r in self.pending_reqs if id(r) not in failed]
        for decode_req in self.queue:
            if id(decode_req) in failed:
                continue
            if not decode_req.waiting_for_input:
                keep.append(decode_req)
                continue
            if self.s.metadata_allocator.available_size() <= 0:
                keep.append(decode_req)
                continue
            req = decode_req.req
            # _pre_alloc_fill_len: the prompt (no output yet).
            fill_len = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
            pages = self.s.pages.alloc(fill_len)
            if pages is None:
                keep.append(decode_req)
                continue
            req.harness_pages = pages
            page_size = self.s.pages.page_size
            slots = (
                torch.as_tensor(pages, dtype=torch.int64)[:, None] * page_size
                + torch.arange(page_size)[None, :]
            ).reshape(-1)[:fill_len]
            page_indices = kv_to_page_indices(slots, page_size).astype(np.int32)
            state_indices = [None for _ in self.kv_manager.kv_args.state_types]
            # _send_kv_metadata
            decode_req.metadata_buffer_index = self.s.metadata_allocator.alloc()
            self.s.truth.emit(
                "metadata_published",
                rid=req.rid,
                room=req.bootstrap_room,
                pages=len(page_indices),
                metadata_index=decode_req.metadata_buffer_index,
                fake=_is_fake_transfer(req),
            )
            decode_req.kv_receiver.send_metadata(
                page_indices,
                decode_req.metadata_buffer_index,
                state_indices,
                decode_prefix_len=0,
            )
            req.time_stats.set_decode_transfer_queue_entry_time()
            self.transfer_queue.append(decode_req)
            progressed = True
        self.queue = keep
        return progressed

    # ---- DecodeTransferQueue ----

    def _commit_transfer_to_req(self, decode_req) -> None:
        from sglang.srt.disaggregation.decode import _generate_fake_prefill_handoff_output_id
        from sglang.srt.disaggregation.utils import _is_fake_transfer, prepare_abort

        req = decode_req.req
        idx = decode_req.metadata_buffer_index
        buf = self.s.metadata_buffers.get_buf(idx)
        output_id, cached_tokens, output_bootstrap_room = buf[0], buf[1], buf[-1]
        actual_room = output_bootstrap_room[0].item()
        expected_room = req.bootstrap_room if req.bootstrap_room is not None else 0
        fake = _is_fake_transfer(req)
        if not fake and actual_room != expected_room:
            prepare_abort(
                req,
                "Metadata corruption detected - bootstrap_room mismatch",
                status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
            )
            decode_req.kv_receiver.clear()
            decode_req.kv_receiver = None
            return
        committed = (
            _generate_fake_prefill_handoff_output_id(req) if fake else output_id[0].item()
        )
        req.output_ids.append(committed)
        req.cached_tokens = cached_tokens[0].item()
        req.already_computed = req.cached_tokens
        req.cached_tokens_device = cached_tokens[1].item()
        req.cached_tokens_host = cached_tokens[2].item()
        req.cached_tokens_storage = cached_tokens[3].item()
        decode_req.kv_receiver.clear()
        decode_req.kv_receiver = None
        req.time_stats.set_wait_queue_entry_time()
        if not fake:
            self._record_landed_kv(req, actual_room)

    def _record_landed_kv(self, req, metadata_room: int) -> None:
        """Ground truth: how many leading prompt positions hold exactly the bytes prefill's
        played forward wrote for this room, and their digest (prefill logs its own)."""
        pages = req.harness_pages
        n = len(req.origin_input_ids)
        landed = 0
        while landed < n and self.s.pages.matches_pattern(req.bootstrap_room, pages, landed + 1):
            landed += 1
        self.s.truth.emit(
            "kv_landed",
            rid=req.rid,
            room=req.bootstrap_room,
            metadata_room=metadata_room,
            first_token=req.output_ids[-1],
            input_tokens=n,
            landed_tokens=landed,
            kv_bytes=landed
            * model_dir.NUM_LAYERS
            * 2
            * model_dir.NUM_KV_HEADS
            * model_dir.HEAD_DIM
            * 2,
            kv_digest=self.s.pages.digest(pages, landed) if landed else None,
        )

    def pop_transferred(self) -> bool:
        from sglang.srt.disaggregation.base import KVPoll
        from sglang.srt.disaggregation.utils import _is_fake_transfer, prepare_abort
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        if not self.transfer_queue:
            return False
        polls = []
        for decode_req in self.transfer_queue:
            poll = self._poll(decode_req)
            # _apply_metadata_gate: Success counts once the aux data carries the room.
            if poll == KVPoll.Success and not _is_fake_transfer(decode_req.req):
                room = self.s.metadata_buffers.bootstrap_room[
                    decode_req.metadata_buffer_index, 0
                ].item()
                if room == 0:
                    poll = KVPoll.Transferring
            polls.append(poll)
        keep = []
        progressed = False
        for decode_req, poll in zip(self.transfer_queue, polls):
            req = decode_req.req
            if poll == KVPoll.Failed:
                error_message = (
                    f"Decode transfer failed for request rank=0 {req.rid=} {req.bootstrap_room=}"
                )
                try:
                    decode_req.kv_receiver.failure_exception()
                except Exception as e:
                    error_message += f" with exception {e}"
                logger.error(error_message)
                prepare_abort(req, error_message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
                self.s.truth.emit("transfer_failed", rid=req.rid, room=req.bootstrap_room)
                self.s.stream_output([req])
                deferrable = (
                    self.enable_deferred_kv_release
                    and decode_req.kv_receiver.kv_mgr.enable_deferred_decode_kv_release
                )
                if deferrable and not decode_req.kv_receiver.abort_notified:
                    decode_req.kv_receiver.ensure_abort_notified(force_arm=True)
                if deferrable and decode_req.kv_receiver.abort_notified:
                    self._defer_release(decode_req)
                else:
                    self._do_release(decode_req)
                progressed = True
            elif poll == KVPoll.Success:
                self._commit_transfer_to_req(decode_req)
                self._free_metadata(decode_req)
                if isinstance(req.finished_reason, FINISH_ABORT):
                    self.s.stream_output([req])
                    self._free_pages(req)
                else:
                    self.waiting_queue.append(req)
                progressed = True
            else:
                keep.append(decode_req)
        self.transfer_queue = keep
        return progressed

    def _free_metadata(self, decode_req) -> None:
        idx = decode_req.metadata_buffer_index
        if idx >= 0:
            self.s.metadata_buffers.clear_slot(idx)
            self.s.metadata_allocator.free(idx)
            decode_req.metadata_buffer_index = -1
        self.seen_poll.pop(id(decode_req), None)

    def _free_pages(self, req) -> None:
        if req.harness_pages is not None:
            self.s.pages.clear(req.harness_pages)
            self.s.pages.free(req.harness_pages)
            req.harness_pages = None

    def _do_release(self, decode_req) -> None:
        room = decode_req.req.bootstrap_room
        self._free_pages(decode_req.req)
        self._free_metadata(decode_req)
        self.kv_manager.clear_deferred_abort_state(room)
        if decode_req.kv_receiver is not None:
            decode_req.kv_receiver.clear()
            decode_req.kv_receiver = None

    def _defer_release(self, decode_req) -> None:
        start = time.monotonic()
        required_acks = (
            len(decode_req.kv_receiver.bootstrap_infos)
            if decode_req.kv_receiver.abort_notified
            else 0
        )
        self.deferred_releases.append(
            (decode_req, start, start + self.deferred_kv_release_timeout, required_acks)
        )
        self.s.truth.emit(
            "kv_release_deferred",
            rid=decode_req.req.rid,
            room=decode_req.req.bootstrap_room,
            required_acks=required_acks,
        )

    def resolve_deferred_releases(self) -> None:
        if not self.deferred_releases:
            return
        now = time.monotonic()
        held = []
        for entry in self.deferred_releases:
            decode_req, start, deadline, required_acks = entry
            room = decode_req.req.bootstrap_room
            drained = self.kv_manager.is_abort_release_safe(room, required_acks)
            if drained or now >= deadline:
                self.s.truth.emit(
                    "kv_released",
                    rid=decode_req.req.rid,
                    room=room,
                    outcome="drained" if drained else "timeout",
                    held_ms=round((now - start) * 1000, 3),
                )
                self._do_release(decode_req)
            else:
                held.append(entry)
        self.deferred_releases = held

    # ---- the played decode loop ----

    def run_prebuilt(self) -> bool:
        """_get_new_prebuilt_batch + process_batch_result_prebuilt: the first token (from
        prefill) is streamed, then the request joins the running batch."""
        from sglang.srt.observability.req_time_stats import set_time_batch

        if not self.waiting_queue:
            return False
        batch, self.waiting_queue = self.waiting_queue, []
        set_time_batch(batch, "set_forward_entry_time")
        for req in batch:
            req.time_stats.set_decode_prebuilt_finish_time()
            req.update_finish_state()
            if req.finished():
                req.time_stats.set_quick_finish_time()
        self.s.stream_output(batch)
        for req in batch:
            if req.finished():
                self._finish(req)
            else:
                self.running.append(req)
        return True

    def run_decode_step(self) -> bool:
        """One decode forward of the running batch and process_batch_result_decode: a token
        each (an abort set by abort_request lands through update_finish_state)."""
        if not self.running:
            return False
        now = time.perf_counter()
        if (now - self.last_decode_step) * 1000 < self.s.settings.decode_step_ms:
            return False
        self.last_decode_step = now
        batch = self.running
        self.s.schedule_event(batch, "DECODE")
        for req in batch:
            req.time_stats.set_last_decode_finish_time()
            req.output_ids.append(model_dir.GENERATED_TOKEN_ID)
            req.update_finish_state(1)
        self.s.stream_output(batch)
        self.running = []
        for req in batch:
            if req.finished():
                self._finish(req)
            else:
                self.running.append(req)
        return True

    def _finish(self, req) -> None:
        req.time_stats.set_completion_time()
        self._free_pages(req)

    # ---- Scheduler.abort_request, decode branches ----

    def abort_request(self, recv_req) -> None:
        from sglang.srt.managers.io_struct import AbortReq
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        def matches(req) -> bool:
            return recv_req.abort_all or req.rid.startswith(recv_req.rid)

        keep = []
        for req in self.waiting_queue:
            if not matches(req):
                keep.append(req)
                continue
            self.s.ipc.send_to_tokenizer.send_output(
                AbortReq(rid=req.rid, finished_reason=recv_req.finished_reason), req
            )
            if req.finished_reason is None:
                req.finished_reason = FINISH_ABORT()
            self._free_pages(req)
            self.s.truth.emit("aborted", rid=req.rid, room=req.bootstrap_room, queue="waiting")
        self.waiting_queue = keep
        for decode_req in self.queue:
            if matches(decode_req.req):
                decode_req.kv_receiver.abort()
                self.s.truth.emit(
                    "aborted",
                    rid=decode_req.req.rid,
                    room=decode_req.req.bootstrap_room,
                    queue="prealloc",
                )
        for decode_req in self.transfer_queue:
            if matches(decode_req.req):
                decode_req.kv_receiver.abort()
                self.s.truth.emit(
                    "aborted",
                    rid=decode_req.req.rid,
                    room=decode_req.req.bootstrap_room,
                    queue="transfer",
                )
        for req in self.running:
            if not req.finished() and matches(req):
                req.to_finish = FINISH_ABORT()
                self.s.truth.emit("aborted", rid=req.rid, room=req.bootstrap_room, queue="running")

    def step(self) -> bool:
        """One pass of event_loop_normal_disagg_decode; True if anything moved."""
        self.resolve_deferred_releases()
        progressed = self.pop_preallocated()
        progressed = self.pop_transferred() or progressed
        progressed = self.run_prebuilt() or progressed
        return self.run_decode_step() or progressed
