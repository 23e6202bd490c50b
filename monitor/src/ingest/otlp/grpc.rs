//! OTLP/gRPC: the generated `TraceService` / `LogsService` servers from `opentelemetry-proto`.
//!
//! tonic enforces the message size limit on the frame as sent and while decompressing
//! (decompression-bomb guard), and decodes the request before our handler runs. Resending the
//! same bytes cannot help, so a response layer rewrites tonic's codes for those to
//! INVALID_ARGUMENT, which the OTLP spec and every exporter treat as permanent: tonic's
//! OUT_OF_RANGE is retryable in the spec, and the opentelemetry-python exporter retries
//! RESOURCE_EXHAUSTED even without RetryInfo; INTERNAL (tonic's decode error) says "our bug"
//! where the client's bytes are at fault. The same layer counts every non-OK status by code and
//! counts tonic's refusals as rejected exports (one item each). Our handler returns none of
//! INTERNAL, OUT_OF_RANGE or RESOURCE_EXHAUSTED, so every such code came from tonic.

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
use tonic::service::interceptor::ResponseBody;
use tonic::{Request, Response, Status};

use super::{AcceptError, Ingest, RejectReason, Transport};
use crate::access::{Access, Incoming, Server};

#[derive(Clone)]
pub struct GrpcReceiver {
    ingest: Arc<Ingest>,
}

fn status(ingest: &Ingest, e: AcceptError) -> Status {
    let (reason, st) = match e {
        // UNAVAILABLE is what OTLP exporters retry with backoff.
        AcceptError::Full => (
            RejectReason::PipelineFull,
            Status::unavailable(e.to_string()),
        ),
        AcceptError::Closed => (
            RejectReason::PipelineClosed,
            Status::unavailable(e.to_string()),
        ),
        AcceptError::TooManyItems { .. } => (
            RejectReason::TooManyItems,
            Status::invalid_argument(e.to_string()),
        ),
    };
    ingest.log_refusal(Transport::Grpc, reason, st.code() as u16, st.message());
    st
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
            Err(e) => Err(status(&self.ingest, e)),
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
            Err(e) => Err(status(&self.ingest, e)),
        }
    }
}

const INVALID_ARGUMENT: usize = 3;
const RESOURCE_EXHAUSTED: usize = 8;
const OUT_OF_RANGE: usize = 11;
const INTERNAL: usize = 13;

fn rewrite_status<B>(ingest: &Ingest, resp: &mut http::Response<B>) {
    // Trailers-only responses (every error of a unary call) carry the status in the headers.
    let Some(code) = resp
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse::<usize>().ok())
    else {
        return;
    };
    if code == 0 {
        return;
    }
    let refused = match code {
        OUT_OF_RANGE | RESOURCE_EXHAUSTED => Some((RejectReason::TooLarge, INVALID_ARGUMENT)),
        INTERNAL => Some((RejectReason::Malformed, INVALID_ARGUMENT)),
        _ => None,
    };
    let code = match refused {
        Some((reason, new_code)) => {
            ingest.stats.rejected(Transport::Grpc, reason, 1);
            let msg = resp
                .headers()
                .get("grpc-message")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            ingest.log_refusal(Transport::Grpc, reason, new_code as u16, &msg);
            resp.headers_mut()
                .insert("grpc-status", http::HeaderValue::from(new_code));
            new_code
        }
        None => code,
    };
    ingest.stats.grpc_error_responses[code.min(16)].fetch_add(1, Relaxed);
}

/// Refuses an export without the bearer token (before tonic decodes it): UNAUTHENTICATED,
/// which exporters do not retry. Nothing of it reaches the engine.
fn authorize(ingest: &Ingest, access: &Access, req: &Request<()>) -> Result<(), Status> {
    let Some(token) = &access.token else {
        return Ok(());
    };
    let given = req.metadata().get("authorization").map(|v| v.as_bytes());
    if token.admits(given) {
        return Ok(());
    }
    access.stats.unauthenticated(Server::OtlpGrpc);
    ingest
        .stats
        .rejected(Transport::Grpc, RejectReason::Unauthenticated, 1);
    let st = Status::unauthenticated("missing or wrong bearer token (authorization metadata)");
    ingest.log_refusal(
        Transport::Grpc,
        RejectReason::Unauthenticated,
        st.code() as u16,
        st.message(),
    );
    Err(st)
}

/// Serves until `shutdown` resolves; `incoming` is bound by the caller (so tests can use port
/// 0). Over TLS, only connections that completed their handshake reach tonic.
pub async fn serve(
    incoming: Incoming,
    ingest: Arc<Ingest>,
    max_message_bytes: usize,
    access: Access,
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
    let rewrite = {
        let ingest = ingest.clone();
        tower::util::MapResponseLayer::new(
            move |mut resp: http::Response<ResponseBody<tonic::body::Body>>| {
                rewrite_status(&ingest, &mut resp);
                resp
            },
        )
    };
    let auth = {
        let access = access.clone();
        tonic::service::InterceptorLayer::new(move |req: Request<()>| {
            authorize(&ingest, &access, &req).map(|()| req)
        })
    };
    // The rewrite sits outside the token check, so UNAUTHENTICATED is counted by code too.
    let router = tonic::transport::Server::builder()
        .layer(tower::ServiceBuilder::new().layer(rewrite).layer(auth))
        .add_service(traces)
        .add_service(logs);
    match incoming {
        Incoming::Tls(listener) => {
            router
                .serve_with_incoming_shutdown(listener.incoming(), shutdown)
                .await
        }
        Incoming::Plain(listener) => {
            // Exports are latency-sensitive acks, not bulk streams: no Nagle delay.
            let incoming =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
    }
}
