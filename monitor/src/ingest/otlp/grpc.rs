//! OTLP/gRPC: the generated `TraceService` / `LogsService` servers from `opentelemetry-proto`.
//!
//! tonic enforces the message size limit on the frame as sent (OUT_OF_RANGE) and while
//! decompressing (decompression-bomb guard: RESOURCE_EXHAUSTED); decode errors get INTERNAL. A response layer counts every non-OK status by code, including those tonic
//! produced before our handler ran.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::{
    LogsService, LogsServiceServer,
};
use opentelemetry_proto::tonic::collector::logs::v1::{
    ExportLogsServiceRequest, ExportLogsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use tonic::codec::CompressionEncoding;
use tonic::{Request, Response, Status};

use super::{AcceptError, Ingest, OtlpStats, Transport};

#[derive(Clone)]
pub struct GrpcReceiver {
    ingest: Arc<Ingest>,
}

fn status(e: AcceptError) -> Status {
    match e {
        // UNAVAILABLE is what OTLP exporters retry with backoff.
        AcceptError::Full | AcceptError::Closed => Status::unavailable(e.to_string()),
        AcceptError::TooManyItems { .. } => Status::invalid_argument(e.to_string()),
    }
}

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        req: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        match self.ingest.accept_traces(req.get_ref(), Transport::Grpc) {
            Ok(_) => Ok(Response::new(ExportTraceServiceResponse {
                partial_success: None,
            })),
            Err(e) => {
                tracing::debug!(error = %e, "otlp/grpc: traces export refused");
                Err(status(e))
            }
        }
    }
}

#[tonic::async_trait]
impl LogsService for GrpcReceiver {
    async fn export(
        &self,
        req: Request<ExportLogsServiceRequest>,
    ) -> Result<Response<ExportLogsServiceResponse>, Status> {
        match self.ingest.accept_logs(req.get_ref(), Transport::Grpc) {
            Ok(_) => Ok(Response::new(ExportLogsServiceResponse {
                partial_success: None,
            })),
            Err(e) => {
                tracing::debug!(error = %e, "otlp/grpc: logs export refused");
                Err(status(e))
            }
        }
    }
}

fn count_status<B>(stats: &OtlpStats, resp: &http::Response<B>) {
    // Trailers-only responses (every error of a unary call) carry the status in the headers.
    if let Some(code) = resp
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<usize>().ok())
        && code != 0
    {
        stats.grpc_error_responses[code.min(16)].fetch_add(1, Relaxed);
        tracing::debug!(code, "otlp/grpc: error response");
    }
}

/// Serves until `shutdown` resolves; `listener` is bound by the caller (so tests can use port 0).
pub async fn serve(
    listener: tokio::net::TcpListener,
    ingest: Arc<Ingest>,
    max_message_bytes: usize,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let recv = GrpcReceiver {
        ingest: ingest.clone(),
    };
    let traces = TraceServiceServer::new(recv.clone())
        .accept_compressed(CompressionEncoding::Gzip)
        .max_decoding_message_size(max_message_bytes);
    let logs = LogsServiceServer::new(recv)
        .accept_compressed(CompressionEncoding::Gzip)
        .max_decoding_message_size(max_message_bytes);
    let stats = ingest.stats.clone();
    let layer =
        tower::util::MapResponseLayer::new(move |resp: http::Response<tonic::body::Body>| {
            count_status(&stats, &resp);
            resp
        });
    // Exports are latency-sensitive acks, not bulk streams: no Nagle delay.
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .layer(layer)
        .add_service(traces)
        .add_service(logs)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
