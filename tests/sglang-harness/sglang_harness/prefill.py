"""The prefill side of the played scheduler: `PrefillBootstrapQueue` and
`SchedulerDisaggregationPrefillMixin` (srt/disaggregation/prefill.py), with SGLang's
`MooncakeKVSender`s doing every handshake and transfer.

A request's life, as in prefill.py:
1. `add` (PrefillBootstrapQueue.add): an intake reject is retired before any sender exists
   (0.5.21+, `--intake-reject fixed`), or, with `--intake-reject stub` (SGLang <= 0.5.20), it
   keeps its one-token stub prompt (`Req.set_finish_with_abort`) and goes on like any request.
   `create_sender` checks KV capacity, then creates the sender (FakeKVSender for warmup and
   health checks, whose bootstrap_host is 2.2.2.2).
2. `pop_bootstrapped`: polls the senders; WaitingForInput means decode published its
   destinations: `finalize_bootstrap` (metadata buffer, `sender.init(num_pages, idx)`). Under
   `prefill_complete` a Bootstrapping request is prefilled before decode allocates.
3. The played forward (one batch per step): pages allocated and filled, the first token
   appended, then `send_kv_chunk(last_chunk=True)`: `MetadataBuffers.set_buf`, then
   `sender.send(page_indices, state_indices)`.
4. `process_disagg_prefill_inflight_queue`: polls until Success (answer with the one token,
   finish_reason length 0, unless the request carried an abort) or Failed.
"""

import logging
import time
from http import HTTPStatus
from typing import List

from . import model_dir
from .truth import poll_name

logger = logging.getLogger(__name__)


class PrefillSide:
    def __init__(self, sched):
        from sglang.srt.disaggregation.prefill import max_bootstrap_input_len
        from sglang.srt.disaggregation.utils import TransferBackend
        from sglang.srt.runtime_context import get_disagg

        self.s = sched
        self.kv_manager = sched.kv_manager
        self.transfer_backend = TransferBackend(get_disagg().disaggregation_transfer_backend)
        self.bootstrap_port = get_disagg().disaggregation_bootstrap_port
        self.policy = get_disagg().disaggregation_decode_allocation_policy
        self.max_input_len = max_bootstrap_input_len(
            capacity=sched.max_total_num_tokens,
            page_size=sched.pages.page_size,
            shard_size=1,
        )
        self.bootstrap_queue: List = []
        self.waiting_queue: List = []
        self.inflight_queue: List = []
        self.last_forward = 0.0
        # Last poll reported per room, so the truth log records each change once.
        self.seen_poll = {}

    def is_fully_idle(self) -> bool:
        return not (self.bootstrap_queue or self.waiting_queue or self.inflight_queue)

    # ---- PrefillBootstrapQueue ----

    def add(self, req) -> None:
        """Scheduler._add_request_to_queue: the queue's add, then the queue-entry stamp."""
        self._add(req)
        req.time_stats.set_prefill_bootstrap_queue_entry_time()

    def _add(self, req) -> None:
        from sglang.srt.disaggregation.utils import is_unadmitted_reject

        if is_unadmitted_reject(req):
            if self.s.settings.intake_reject == "fixed":
                self.s.retire_unadmitted_request(req)
                return
            self.s.truth.emit(
                "stub_admitted",
                rid=req.rid,
                room=req.bootstrap_room,
                input_tokens=len(req.origin_input_ids),
            )
        if not self.create_sender(req):
            return
        self.bootstrap_queue.append(req)

    def create_sender(self, req) -> bool:
        from sglang.srt.disaggregation.utils import (
            FAKE_BOOTSTRAP_HOST,
            KVClassType,
            TransferBackend,
            get_kv_class,
        )

        if self._check_if_req_exceed_kv_capacity(req):
            return False
        backend = (
            TransferBackend.FAKE
            if req.bootstrap_host == FAKE_BOOTSTRAP_HOST
            else self.transfer_backend
        )
        sender_class = get_kv_class(backend, KVClassType.SENDER)
        req.disagg_kv_sender = sender_class(
            mgr=self.kv_manager,
            bootstrap_addr=f"{req.bootstrap_host}:{self.bootstrap_port}",
            bootstrap_room=req.bootstrap_room,
            req_has_disagg_prefill_dp_rank=req.disagg_prefill_dp_rank is not None,
        )
        req.harness_fake = backend == TransferBackend.FAKE
        self.s.truth.emit(
            "sender_created",
            rid=req.rid,
            room=req.bootstrap_room,
            backend=backend.value,
            input_tokens=len(req.origin_input_ids),
        )
        # _process_req
        req.sampling_params.max_new_tokens = 1
        req.pending_bootstrap = True
        req.harness_pages = None
        return True

    def _check_if_req_exceed_kv_capacity(self, req) -> bool:
        from sglang.srt.disaggregation.utils import prepare_abort

        if len(req.origin_input_ids) > self.max_input_len:
            message = (
                f"Request {req.rid} exceeds the maximum number of tokens: "
                f"{len(req.origin_input_ids)} > {self.max_input_len}"
            )
            logger.error(message)
            req.time_stats.trace_ctx.abort(abort_info={"reason": message})
            prepare_abort(req, message, status_code=HTTPStatus.BAD_REQUEST)
            self.s.truth.emit("capacity_reject", rid=req.rid, room=req.bootstrap_room)
            self.s.stream_output([req])
            return True
        return False

    def _ensure_metadata_buffer(self, req) -> bool:
        if req.metadata_buffer_index >= 0:
            return True
        if self.s.metadata_allocator.available_size() == 0:
            return False
        req.metadata_buffer_index = self.s.metadata_allocator.alloc()
        return True

    def _finalize_bootstrap(self, req) -> bool:
        from sglang.srt.mem_cache.common import kv_to_page_num

        if not self._ensure_metadata_buffer(req):
            return False
        req.time_stats.set_bootstrap_done_time()
        decode_prefix_len = req.disagg_kv_sender.pop_decode_prefix_len()
        req.start_send_idx = decode_prefix_len
        req.disagg_decode_prefix_len = decode_prefix_len
        num_pages = kv_to_page_num(
            len(req.origin_input_ids) - decode_prefix_len, self.s.pages.page_size
        )
        req.disagg_kv_sender.init(num_pages, req.metadata_buffer_index)
        req.pending_bootstrap = False
        self.s.truth.emit(
            "sender_init",
            rid=req.rid,
            room=req.bootstrap_room,
            num_pages=num_pages,
            metadata_index=req.metadata_buffer_index,
        )
        return True

    def _poll(self, req) -> int:
        poll = req.disagg_kv_sender.poll()
        key = id(req)
        if self.seen_poll.get(key) != poll:
            self.seen_poll[key] = poll
            self.s.truth.emit(
                "sender_poll", rid=req.rid, room=req.bootstrap_room, status=poll_name(poll)
            )
        return poll

    def pop_bootstrapped(self) -> List:
        from sglang.srt.disaggregation.base import KVPoll

        done, keep = [], []
        for req in self.bootstrap_queue:
            poll = self._poll(req)
            if poll == KVPoll.Failed:
                self.handle_bootstrap_failure(req)
            elif poll == KVPoll.Bootstrapping:
                # can_prefill_before_bootstrap: optimistic attempts (default 0) or the
                # prefill_complete policy, which always prefills first.
                if self.policy == "prefill_complete" and not req.harness_fake:
                    if not self._ensure_metadata_buffer(req):
                        keep.append(req)
                        continue
                    req.prefill_attempt_count += 1
                    done.append(req)
                    req.time_stats.set_wait_queue_entry_time()
                else:
                    keep.append(req)
            elif poll == KVPoll.WaitingForInput:
                if not self._finalize_bootstrap(req):
                    keep.append(req)
                    continue
                done.append(req)
                req.time_stats.set_wait_queue_entry_time()
            else:
                raise RuntimeError(f"Unexpected poll state {poll} for req {req.rid}")
        self.bootstrap_queue = keep
        return done

    # ---- SchedulerDisaggregationPrefillMixin ----

    def handle_bootstrap_failure(self, req) -> None:
        from sglang.srt.disaggregation.utils import prepare_abort
        from sglang.srt.runtime_context import get_parallel

        error_message = (
            f"Prefill bootstrap failed for request rank={get_parallel().tp_rank} "
            f"{req.rid=} {req.bootstrap_room=}"
        )
        try:
            req.disagg_kv_sender.failure_exception()
        except Exception as e:
            error_message += f" with exception {e}"
        logger.warning(error_message)
        req.time_stats.trace_ctx.abort(abort_info={"reason": error_message})
        self._release(req)
        req.pending_bootstrap = False
        prepare_abort(req, error_message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
        self.s.truth.emit("bootstrap_failed", rid=req.rid, room=req.bootstrap_room)
        self.s.stream_output([req])

    def _release(self, req) -> None:
        from sglang.srt.disaggregation.prefill import maybe_release_metadata_buffer

        self.s.pages.free(getattr(req, "harness_pages", None))
        req.harness_pages = None
        maybe_release_metadata_buffer(req, self.s.metadata_allocator)
        self.seen_poll.pop(id(req), None)

    def run_batch(self) -> bool:
        """get_new_batch_prefill + run_batch + process_batch_result_disagg_prefill, played: the
        whole waiting queue is one batch whose forward writes each request's KV."""
        from sglang.srt.disaggregation.utils import is_aborted

        batch = []
        for req in self.waiting_queue:
            if is_aborted(req) and req.to_finish is None:
                continue
            pages = self.s.pages.alloc(len(req.origin_input_ids))
            if pages is None:
                break
            req.harness_pages = pages
            batch.append(req)
        if not batch:
            return False
        self.waiting_queue = self.waiting_queue[len(batch) :]
        ts = time.perf_counter()
        for req in batch:
            req.time_stats.set_forward_entry_time(ts)
        self.s.schedule_event(batch, "EXTEND")
        # The played model forward.
        for req in batch:
            if not req.harness_fake:
                self.s.pages.fill(req.bootstrap_room, req.harness_pages, len(req.origin_input_ids))
        if self.s.settings.forward_ms > 0:
            time.sleep(self.s.settings.forward_ms / 1000)
        self.process_batch_result(batch)
        return True

    def process_batch_result(self, batch: List) -> None:
        from sglang.srt.disaggregation.utils import is_aborted

        aborted = []
        for req in batch:
            req.time_stats.set_prefill_finished_time()
            # 0.5.21+: "Its KV never landed: abort instead of sending it to decode." A stub
            # (`--intake-reject stub`) carries its verdict in to_finish and goes on, as the
            # one-token stub did before the fix.
            if is_aborted(req) and not (
                self.s.settings.intake_reject == "stub" and req.to_finish is not None
            ):
                try:
                    req.disagg_kv_sender.abort()
                except Exception:
                    logger.exception("Failed to notify KV sender of abort for %s", req.rid)
                if req.to_finish is not None and not req.finished():
                    req.update_finish_state()
                self._release(req)
                req.time_stats.set_completion_time()
                aborted.append(req)
                continue
            req.output_ids.append(model_dir.GENERATED_TOKEN_ID)
            self.inflight_queue.append(req)
            if self.policy == "prefill_complete":
                req.disagg_kv_sender.mark_prefill_complete()
                self.s.truth.emit("prefill_complete", rid=req.rid, room=req.bootstrap_room)
            if not req.pending_bootstrap:
                self.send_kv_chunk(req)
            req.time_stats.set_prefill_transfer_queue_entry_time()
        if aborted:
            self.s.stream_output(aborted)

    def send_kv_chunk(self, req) -> None:
        """_send_kv_chunk(last_chunk=True) for an MHA pool: the whole prompt in one send."""
        from sglang.srt.mem_cache.common import kv_to_page_indices

        import torch

        page_size = self.s.pages.page_size
        n = len(req.origin_input_ids)
        self.s.metadata_buffers.set_buf(req)
        start = req.start_send_idx
        pages = req.harness_pages
        slots = (
            torch.as_tensor(pages, dtype=torch.int64)[:, None] * page_size
            + torch.arange(page_size)[None, :]
        ).reshape(-1)[start:n]
        page_indices = kv_to_page_indices(slots, page_size)
        state_indices = [None for _ in self.kv_manager.kv_args.state_types]
        sender = req.disagg_kv_sender
        if sender.should_send_kv_chunk(len(page_indices), True):
            digest = None if req.harness_fake else self.s.pages.digest(pages, n)
            self.s.truth.emit(
                "kv_sent",
                rid=req.rid,
                room=req.bootstrap_room,
                pages=len(page_indices),
                tokens=n - start,
                kv_digest=digest,
            )
            sender.send(page_indices, state_indices, num_kv_tokens=n - start)
        req.start_send_idx = n

    def process_inflight_queue(self) -> bool:
        from sglang.srt.disaggregation.base import KVPoll
        from sglang.srt.disaggregation.utils import prepare_abort
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH
        from sglang.srt.runtime_context import get_parallel

        if not self.inflight_queue:
            return False
        done, undone = [], []
        for req in self.inflight_queue:
            poll = self._poll(req)
            if req.pending_bootstrap:
                # handle_pending_bootstrap: prefill finished before decode allocated.
                if poll == KVPoll.Failed:
                    self.handle_bootstrap_failure(req)
                elif poll == KVPoll.WaitingForInput:
                    self._finalize_bootstrap(req)
                    self.send_kv_chunk(req)
                    undone.append(req)
                else:
                    undone.append(req)
                continue
            if poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
                undone.append(req)
            elif poll == KVPoll.Success:
                # A stub's abort (`to_finish`) becomes its finished_reason here.
                req.update_finish_state()
                if not isinstance(req.finished_reason, FINISH_ABORT):
                    req.finished_reason = FINISH_LENGTH(length=0)
                req.disagg_kv_sender.clear()
                done.append(req)
                req.time_stats.set_prefill_kv_transfer_finish_time()
            elif poll == KVPoll.Failed:
                error_message = (
                    f"Prefill transfer failed for request rank={get_parallel().tp_rank} "
                    f"{req.rid=} {req.bootstrap_room=}"
                )
                try:
                    req.disagg_kv_sender.failure_exception()
                except Exception as e:
                    error_message += f" with exception {e}"
                logger.warning(error_message)
                req.time_stats.trace_ctx.abort(abort_info={"reason": error_message})
                if req.finished_reason is None:
                    req.finished_reason = FINISH_LENGTH(length=0)
                if not isinstance(req.finished_reason, FINISH_ABORT):
                    prepare_abort(
                        req, error_message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR
                    )
                self.s.truth.emit("transfer_failed", rid=req.rid, room=req.bootstrap_room)
                done.append(req)
            else:
                raise RuntimeError(f"Unexpected poll state {poll} for req {req.rid}")
        for req in done:
            req.time_stats.set_completion_time()
        self.s.stream_output(done)
        for req in done:
            self._release(req)
        self.inflight_queue = undone
        return bool(done)

    def abort_request(self, recv_req) -> None:
        """Scheduler.abort_request, prefill branches: a waiting request is dropped (Abort
        method 1 + release_aborted_prefill_waiting_req); bootstrapping and in-flight ones have
        their sender aborted."""
        from sglang.srt.managers.io_struct import AbortReq

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
            sender = getattr(req, "disagg_kv_sender", None)
            if sender is not None:
                sender.abort()
            self._release(req)
            req.pending_bootstrap = False
            self.s.truth.emit("aborted", rid=req.rid, room=req.bootstrap_room, queue="waiting")
        self.waiting_queue = keep
        for queue, name in ((self.bootstrap_queue, "bootstrap"), (self.inflight_queue, "inflight")):
            for req in queue:
                if matches(req):
                    req.disagg_kv_sender.abort()
                    self.s.truth.emit("aborted", rid=req.rid, room=req.bootstrap_room, queue=name)

    def step(self) -> bool:
        """One pass of event_loop_normal_disagg_prefill; True if anything moved."""
        progressed = False
        bootstrapped = self.pop_bootstrapped()
        if bootstrapped:
            self.waiting_queue.extend(bootstrapped)
            progressed = True
        if self.waiting_queue:
            progressed = self.run_batch() or progressed
        return self.process_inflight_queue() or progressed
