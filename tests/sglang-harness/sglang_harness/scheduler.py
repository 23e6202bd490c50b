"""The played scheduler process: what `run_scheduler_process` and `Scheduler`
(srt/managers/scheduler.py) do for a TP1/PP1/DP1 PD worker, minus the model.

SGLang's `launch_server` starts this in place of its scheduler process
(`run_scheduler_process_func`); SGLang's own tokenizer manager, HTTP server and detokenizer
process surround it. Requests arrive over SGLang's IPC socket as `TokenizedGenerateReqInput`
and become SGLang `Req`s; their outputs leave through SGLang's `SchedulerOutputStreamer` to the
detokenizer. The disaggregation parts (`prefill.PrefillSide`, `decode.DecodeSide`) drive
SGLang's KV manager, senders and receivers.

Played here, in place of SGLang's: the event loop's batching (every ready request is one batch),
the model forward (`kv.PagePool.fill`, a fixed next token), the radix/tree cache (none), and
the memory accounting (a page free list). Harness settings come from `SGLANG_HARNESS_*`
environment variables (set by `worker.py`), since `launch_server` spawns this process with
SGLang's fixed arguments.
"""

import logging
import os
import time
from http import HTTPStatus
from typing import List

import zmq

from .truth import TruthLog

logger = logging.getLogger(__name__)


class HarnessSettings:
    def __init__(self):
        env = os.environ
        self.kv_pages = int(env.get("SGLANG_HARNESS_KV_PAGES", "512"))
        self.metadata_slots = int(env.get("SGLANG_HARNESS_METADATA_SLOTS", "64"))
        self.intake_reject = env.get("SGLANG_HARNESS_INTAKE_REJECT", "fixed")
        self.truth_log = env.get("SGLANG_HARNESS_TRUTH_LOG") or None
        self.forward_ms = float(env.get("SGLANG_HARNESS_FORWARD_MS", "2"))
        self.decode_step_ms = float(env.get("SGLANG_HARNESS_DECODE_STEP_MS", "5"))


def run_scheduler_process(
    server_args,
    port_args,
    gpu_id,
    tp_rank,
    pp_rank,
    dp_rank,
    pipe_writer,
    *args,
    **kwargs,
):
    """Stands in for sglang.srt.managers.scheduler.run_scheduler_process (same arguments):
    the same publish, logger, process title and tracing set-up, then the played scheduler."""
    import faulthandler

    import setproctitle

    from sglang.srt.managers.scheduler import resolve_spawn_dp_rank
    from sglang.srt.observability.trace import process_tracing_init, trace_set_thread_info
    from sglang.srt.runtime_context import (
        SpawnRanks,
        get_disagg,
        get_observability,
        get_parallel,
        publish,
        spawn_world_rank,
    )
    from sglang.srt.utils import configure_logger

    dp_rank = resolve_spawn_dp_rank(dp_rank)
    publish(
        server_args,
        role="scheduler",
        ranks=SpawnRanks(
            world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=pp_rank),
            dp_rank=dp_rank,
            gpu_id=gpu_id,
        ),
    )
    # A TP1/PP1 worker builds no torch.distributed groups here; the KV managers only keep a
    # reference to the pipeline group (used when pp_size > 1).
    get_parallel().override_permanently(pp_group=None)
    setproctitle.setproctitle("sglang::scheduler")
    faulthandler.enable()
    configure_logger(server_args, prefix="")

    if get_observability().enable_trace:
        process_tracing_init(
            get_observability().otlp_traces_endpoint,
            get_observability().otlp_service_name,
            trace_modules=get_observability().trace_modules,
        )
        thread_label = "Scheduler"
        if get_disagg().disaggregation_mode == "prefill":
            thread_label = "Prefill Scheduler"
        elif get_disagg().disaggregation_mode == "decode":
            thread_label = "Decode Scheduler"
        trace_set_thread_info(thread_label, tp_rank, dp_rank, pp_rank)

    scheduler = PlayedScheduler(server_args, port_args, gpu_id, tp_rank)
    pipe_writer.send(scheduler.get_init_info())
    scheduler.run()


class _NoTreeCache:
    """The scheduler's tree cache, for what the output streamer asks of it: none here."""

    cache_controller = None

    def finish(self, *args, **kwargs):
        pass


class PlayedScheduler:
    def __init__(self, server_args, port_args, gpu_id: int, tp_rank: int):
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            MetadataBuffers,
            ReqToMetadataIdxAllocator,
        )
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            maybe_init_shared_mooncake_transfer_engine,
        )
        from sglang.srt.managers.scheduler_components.ipc_channels import (
            SchedulerIpcChannels,
        )
        from sglang.srt.managers.scheduler_components.output_streamer import (
            SchedulerOutputStreamer,
        )
        from sglang.srt.observability.startup_time import build_scheduler_startup_time
        from sglang.srt.runtime_context import get_disagg, get_model, get_serving
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer

        from . import kv, model_dir

        started = time.perf_counter()
        self.settings = HarnessSettings()
        self.server_args = server_args
        self.mode = DisaggregationMode(get_disagg().disaggregation_mode)
        self.truth = TruthLog(self.settings.truth_log, self.mode.value)
        if self.settings.truth_log:
            from . import frames

            frames.install(self.truth)

        # Scheduler.init_ipc_channels
        self.ipc = SchedulerIpcChannels.create(
            port_args=port_args,
            is_rank_zero=True,
            skip_tokenizer_init=False,
            metrics_enabled=False,
            enable_scripted_runtime=False,
        )
        # Scheduler.init_tokenizer (used by stop-string checks on Req)
        self.tokenizer = get_tokenizer(
            get_serving().tokenizer_path,
            tokenizer_mode=get_serving().tokenizer_mode,
            trust_remote_code=get_model().trust_remote_code,
            revision=get_model().revision,
            tokenizer_backend=get_serving().tokenizer_backend,
        )

        # ModelRunner: the shared Mooncake transfer engine, then the KV pool.
        maybe_init_shared_mooncake_transfer_engine(gpu_id=gpu_id)
        self.pages = kv.PagePool(self.settings.kv_pages, server_args.page_size)
        # TpModelWorker.get_worker_info
        context_len = server_args.context_length
        self.max_total_num_tokens = self.pages.capacity_tokens
        self.max_req_len = min(context_len - 1, self.max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.vocab_size = model_dir.CONFIG["vocab_size"]

        # Scheduler.init_disaggregation
        self.metadata_allocator = ReqToMetadataIdxAllocator(self.settings.metadata_slots)
        self.metadata_buffers = MetadataBuffers(
            self.settings.metadata_slots,
            hidden_size=model_dir.HIDDEN,
            hidden_states_dtype=kv.KV_DTYPE,
            max_sampling_mask_tokens=16,
        )
        self.kv_manager = kv.build_kv_manager(
            self.mode, server_args, self.pages, self.metadata_buffers, tp_rank
        )
        self.output_streamer = SchedulerOutputStreamer(
            send_to_detokenizer=self.ipc.send_to_detokenizer,
            tree_cache=_NoTreeCache(),
            server_args=server_args,
            is_generation=True,
            spec_algorithm=SpeculativeAlgorithm.from_string(None),
            disaggregation_mode=self.mode,
            enable_hicache_storage=lambda: False,
        )
        if self.mode == DisaggregationMode.PREFILL:
            from .prefill import PrefillSide

            self.side = PrefillSide(self)
        else:
            from .decode import DecodeSide

            self.side = DecodeSide(self)

        self.startup_time = build_scheduler_startup_time(
            target_load_weight=0.0,
            draft_load_weight=0.0,
            kv_cache_allocation=0.0,
            scheduler_e2e=time.perf_counter() - started,
            target_cuda_graph=None,
            draft_cuda_graph=None,
        )
        self.truth.emit(
            "worker_ready",
            kv_pages=self.settings.kv_pages,
            page_size=server_args.page_size,
            max_total_num_tokens=self.max_total_num_tokens,
            max_req_input_len=self.max_req_input_len,
            context_length=context_len,
            rank_ip=self.kv_manager.local_ip,
            rank_port=self.kv_manager.rank_port,
            session_id=self.kv_manager.get_session_id(),
            decode_allocation_policy=get_disagg().disaggregation_decode_allocation_policy,
            intake_reject=self.settings.intake_reject,
        )

    def get_init_info(self) -> dict:
        """Scheduler.get_init_info"""
        from sglang.srt.mem_cache.hicache_storage import disabled_l3_layout

        return {
            "status": "ready",
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.max_req_input_len,
            "startup_time": self.startup_time,
            "hicache_object_layout": disabled_l3_layout(
                "Hierarchical cache is disabled", page_size=self.server_args.page_size
            ),
        }

    # ---- intake (Scheduler.ingest_requests / process_input_requests) ----

    def recv_requests(self) -> List:
        from sglang.srt.managers.io_struct import (
            BatchTokenizedGenerateReqInput,
            TokenizedGenerateReqInput,
            sock_recv,
        )

        reqs = []
        for sock in (self.ipc.recv_from_tokenizer, self.ipc.recv_from_rpc):
            if sock is None:
                continue
            while True:
                try:
                    reqs.append(sock_recv(sock, zmq.NOBLOCK))
                except zmq.ZMQError:
                    break
        for r in reqs:
            if isinstance(r, TokenizedGenerateReqInput):
                r.unwrap_pickle_fields()
            elif isinstance(r, BatchTokenizedGenerateReqInput):
                for sub in r:
                    sub.unwrap_pickle_fields()
        return reqs

    def process_input_requests(self, recv_reqs: List) -> None:
        from sglang.srt.managers.io_struct import (
            AbortReq,
            BatchTokenizedGenerateReqInput,
            FreezeGCReq,
            GetInternalStateReq,
            HealthCheckOutput,
            TokenizedGenerateReqInput,
        )
        from sglang.srt.managers.utils import is_health_check_generate_req

        for recv_req in recv_reqs:
            if is_health_check_generate_req(recv_req) and not self.side.is_fully_idle():
                # Scheduler.process_input_requests: busy servers answer health checks
                # with a HealthCheckOutput instead of running them.
                self.ipc.send_to_tokenizer.send_output(
                    HealthCheckOutput(http_worker_ipc=getattr(recv_req, "http_worker_ipc", None))
                )
                continue
            if isinstance(recv_req, TokenizedGenerateReqInput):
                self.handle_generate_request(recv_req)
            elif isinstance(recv_req, BatchTokenizedGenerateReqInput):
                for sub in recv_req:
                    self.handle_generate_request(sub)
            elif isinstance(recv_req, AbortReq):
                self.truth.emit(
                    "abort_req",
                    rid=recv_req.rid,
                    abort_all=bool(recv_req.abort_all),
                )
                self.side.abort_request(recv_req)
            elif isinstance(recv_req, GetInternalStateReq):
                self.ipc.send_to_tokenizer.send_output(self.get_internal_state(), recv_req)
            elif isinstance(recv_req, FreezeGCReq):
                pass
            else:
                logger.warning("harness scheduler ignores %s", type(recv_req).__name__)

    def get_internal_state(self):
        """SchedulerInternalState.get_internal_state, for the fields a PD worker reports."""
        from sglang.srt.managers.io_struct import GetInternalStateReqOutput
        from sglang.srt.runtime_context import get_context
        from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

        state = get_context().resolved_server_args_dict()
        state.pop("custom_sigquit_handler", None)
        state["startup_time"] = self.startup_time
        state["max_total_num_tokens"] = self.max_total_num_tokens
        state["max_req_input_len"] = self.max_req_input_len
        state["last_gen_throughput"] = 0.0
        return GetInternalStateReqOutput(internal_state=msgspec_to_builtins(state))

    def handle_generate_request(self, recv_req) -> None:
        """Scheduler._handle_generate_request for a plain text request."""
        from sglang.srt.disaggregation.utils import prepare_abort
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.managers.utils import validate_input_length
        from sglang.srt.runtime_context import get_disagg, get_serving

        if recv_req.bootstrap_port is None:
            recv_req.bootstrap_port = get_disagg().disaggregation_bootstrap_port
        req = Req(
            recv_req.rid,
            recv_req.input_text,
            recv_req.input_ids,
            recv_req.sampling_params,
            return_logprob=recv_req.return_logprob,
            top_logprobs_num=recv_req.top_logprobs_num,
            token_ids_logprob=recv_req.token_ids_logprob,
            stream=recv_req.stream,
            lora_id=recv_req.lora_id,
            session_id=recv_req.session_id,
            require_reasoning=recv_req.require_reasoning,
            return_hidden_states=recv_req.return_hidden_states,
            eos_token_ids=None,
            bootstrap_host=recv_req.bootstrap_host,
            bootstrap_port=recv_req.bootstrap_port,
            bootstrap_room=recv_req.bootstrap_room,
            disagg_mode=self.mode,
            routed_dp_rank=recv_req.routed_dp_rank,
            disagg_prefill_dp_rank=recv_req.disagg_prefill_dp_rank,
            vocab_size=self.vocab_size,
            priority=recv_req.priority,
            routing_key=recv_req.routing_key,
            extra_key=recv_req.extra_key,
            http_worker_ipc=recv_req.http_worker_ipc,
            time_stats=recv_req.time_stats,
        )
        req.tokenizer = self.tokenizer
        self.truth.emit(
            "request_received",
            rid=req.rid,
            room=req.bootstrap_room,
            bootstrap_host=req.bootstrap_host,
            bootstrap_port=req.bootstrap_port,
            input_tokens=len(req.origin_input_ids),
            max_new_tokens=req.sampling_params.max_new_tokens,
            stream=bool(req.stream),
        )
        if req.bootstrap_room is None:
            error_msg = (
                f"Invalid request: Disaggregated request received without "
                f"bootstrap room id. {req.rid=}"
            )
            logger.error(error_msg)
            recv_req.time_stats.trace_ctx.abort(abort_info={"reason": error_msg})
            prepare_abort(req, error_msg, status_code=HTTPStatus.BAD_REQUEST)
            self.stream_output([req])
            return

        # Scheduler.init_req_max_new_tokens
        max_new = req.sampling_params.max_new_tokens
        max_new = max_new if max_new is not None else 1 << 30
        req.sampling_params.max_new_tokens = max(
            0, min(max_new, self.max_req_len - len(req.origin_input_ids) - 1)
        )
        error_msg = validate_input_length(
            req, self.max_req_input_len, get_serving().allow_auto_truncate
        )
        if error_msg:
            req.set_finish_with_abort(error_msg)
            self.truth.emit(
                "scheduler_reject", rid=req.rid, room=req.bootstrap_room, status_code=400
            )
        self.side.add(req)

    # ---- what several paths share ----

    def stream_output(self, reqs: list) -> None:
        if reqs:
            self.output_streamer.stream_output(reqs, any(r.return_logprob for r in reqs))
            for req in reqs:
                if req.finished():
                    self.truth.emit(
                        "answered",
                        rid=req.rid,
                        room=req.bootstrap_room,
                        finish_reason=req.finished_reason.to_json(),
                        output_tokens=len(req.output_ids),
                    )

    @staticmethod
    def schedule_event(reqs: list, forward_mode: str) -> None:
        """set_schedule_time_batch (srt/observability/req_time_stats.py) for a played batch:
        the "schedule" trace event, and decode's last-scheduled stamp."""
        from types import SimpleNamespace

        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.observability.req_time_stats import set_schedule_time_batch

        if reqs:
            set_schedule_time_batch(
                SimpleNamespace(reqs=reqs, forward_mode=ForwardMode[forward_mode])
            )

    def retire_unadmitted_request(self, req) -> None:
        """Scheduler.retire_unadmitted_request (0.5.21+): an intake reject ends here."""
        reason = req.finished_reason or req.to_finish
        req.time_stats.trace_ctx.abort(abort_info={"reason": reason.message})
        req.update_finish_state()
        self.truth.emit("retired_unadmitted", rid=req.rid, room=req.bootstrap_room)
        self.stream_output([req])

    def run(self) -> None:
        """The event loop: intake, then the role's queues; a short sleep when idle."""
        while True:
            reqs = self.recv_requests()
            self.process_input_requests(reqs)
            progressed = self.side.step()
            if not reqs and not progressed:
                # Idle or waiting on the KV threads: let them have the GIL.
                time.sleep(0.0005)
