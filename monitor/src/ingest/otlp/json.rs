//! OTLP/JSON → the maintained `opentelemetry-proto` types.
//!
//! The OTLP spec asks for hex trace/span ids, integer enums and 64-bit integers as strings, but
//! real senders also follow the plain protobuf-JSON mapping (base64 ids, enum names: that is
//! how `shared/fixtures` is written). The receiver accepts both, ignores unknown fields (as the
//! spec requires) and rejects anything else with a message — it never panics.

use base64::Engine as _;
use opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1 as common;
use opentelemetry_proto::tonic::logs::v1 as logs;
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1 as trace;
use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use std::fmt;

/// The export must be a JSON object (serde would take `[]` for an empty struct).
fn object(body: &[u8]) -> Result<(), serde_json::Error> {
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => Ok(()),
        _ => Err(serde::de::Error::custom(
            "an OTLP/JSON export must be a JSON object",
        )),
    }
}

pub fn decode_traces(body: &[u8]) -> Result<ExportTraceServiceRequest, serde_json::Error> {
    object(body)?;
    let req: TracesReq = serde_json::from_slice(body)?;
    Ok(req.into())
}

pub fn decode_logs(body: &[u8]) -> Result<ExportLogsServiceRequest, serde_json::Error> {
    object(body)?;
    let req: LogsReq = serde_json::from_slice(body)?;
    Ok(req.into())
}

// ---- lenient scalars ----

/// Bytes from hex (spec) or base64 (protobuf-JSON mapping).
#[derive(Default)]
struct Id(Vec<u8>);

impl<'de> Deserialize<'de> for Id {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.is_empty() {
            return Ok(Id(Vec::new()));
        }
        if (s.len() == 32 || s.len() == 16) && s.bytes().all(|b| b.is_ascii_hexdigit()) {
            let v = (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16))
                .collect::<Result<Vec<_>, _>>()
                .map_err(de::Error::custom)?;
            return Ok(Id(v));
        }
        let v = base64::engine::general_purpose::STANDARD
            .decode(s.as_bytes())
            .map_err(|_| de::Error::custom(format!("id {s:?} is neither hex nor base64")))?;
        if v.len() != 16 && v.len() != 8 {
            return Err(de::Error::custom(format!(
                "id {s:?} decodes to {} bytes (want 8 or 16)",
                v.len()
            )));
        }
        Ok(Id(v))
    }
}

/// u64 from a JSON number or a decimal string.
#[derive(Default, Clone, Copy)]
struct U64(u64);

impl<'de> Deserialize<'de> for U64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = U64;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an unsigned integer or a decimal string")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<U64, E> {
                Ok(U64(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<U64, E> {
                u64::try_from(v)
                    .map(U64)
                    .map_err(|_| E::custom("negative value"))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<U64, E> {
                if v >= 0.0 && v.fract() == 0.0 && v < 1.8e19 {
                    Ok(U64(v as u64))
                } else {
                    Err(E::custom("not an integer"))
                }
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<U64, E> {
                v.trim().parse().map(U64).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// i64 from a number or decimal string (AnyValue intValue).
struct I64(i64);

impl<'de> Deserialize<'de> for I64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = I64;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an integer or a decimal string")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<I64, E> {
                i64::try_from(v)
                    .map(I64)
                    .map_err(|_| E::custom("integer out of range"))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<I64, E> {
                Ok(I64(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<I64, E> {
                if v.fract() == 0.0 && v.abs() < 9.2e18 {
                    Ok(I64(v as i64))
                } else {
                    Err(E::custom("not an integer"))
                }
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<I64, E> {
                v.trim().parse().map(I64).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// f64 from a number or the strings protobuf-JSON uses ("NaN", "Infinity", decimal).
struct F64(f64);

impl<'de> Deserialize<'de> for F64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = F64;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<F64, E> {
                Ok(F64(v as f64))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<F64, E> {
                Ok(F64(v as f64))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<F64, E> {
                Ok(F64(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<F64, E> {
                v.trim().parse().map(F64).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// An enum as its integer or its protobuf name.
struct Enum<T>(i32, std::marker::PhantomData<T>);

trait EnumNames {
    fn from_name(s: &str) -> Option<i32>;
}

impl<T> Default for Enum<T> {
    fn default() -> Self {
        Enum(0, std::marker::PhantomData)
    }
}

impl<'de, T: EnumNames> Deserialize<'de> for Enum<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<T: EnumNames> Visitor<'_> for V<T> {
            type Value = Enum<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an enum integer or name")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Enum<T>, E> {
                i32::try_from(v)
                    .map(|v| Enum(v, std::marker::PhantomData))
                    .map_err(|_| E::custom("enum out of range"))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Enum<T>, E> {
                i32::try_from(v)
                    .map(|v| Enum(v, std::marker::PhantomData))
                    .map_err(|_| E::custom("enum out of range"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Enum<T>, E> {
                T::from_name(v)
                    .map(|v| Enum(v, std::marker::PhantomData))
                    .ok_or_else(|| E::custom(format!("unknown enum name {v:?}")))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

struct SpanKindNames;
impl EnumNames for SpanKindNames {
    fn from_name(s: &str) -> Option<i32> {
        trace::span::SpanKind::from_str_name(s).map(|k| k as i32)
    }
}
struct StatusNames;
impl EnumNames for StatusNames {
    fn from_name(s: &str) -> Option<i32> {
        trace::status::StatusCode::from_str_name(s).map(|k| k as i32)
    }
}
struct SeverityNames;
impl EnumNames for SeverityNames {
    fn from_name(s: &str) -> Option<i32> {
        logs::SeverityNumber::from_str_name(s).map(|k| k as i32)
    }
}

// ---- messages ----

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct AnyValue {
    string_value: Option<String>,
    bool_value: Option<bool>,
    int_value: Option<I64>,
    double_value: Option<F64>,
    array_value: Option<ArrayValue>,
    kvlist_value: Option<KvList>,
    bytes_value: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ArrayValue {
    values: Vec<AnyValue>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct KvList {
    values: Vec<KeyValue>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct KeyValue {
    key: String,
    value: Option<AnyValue>,
}

impl From<AnyValue> for common::AnyValue {
    fn from(v: AnyValue) -> Self {
        use common::any_value::Value;
        let value = if let Some(s) = v.string_value {
            Some(Value::StringValue(s))
        } else if let Some(b) = v.bool_value {
            Some(Value::BoolValue(b))
        } else if let Some(i) = v.int_value {
            Some(Value::IntValue(i.0))
        } else if let Some(d) = v.double_value {
            Some(Value::DoubleValue(d.0))
        } else if let Some(a) = v.array_value {
            Some(Value::ArrayValue(common::ArrayValue {
                values: a.values.into_iter().map(Into::into).collect(),
            }))
        } else if let Some(kv) = v.kvlist_value {
            Some(Value::KvlistValue(common::KeyValueList {
                values: kvs(kv.values),
            }))
        } else {
            v.bytes_value.map(|b| {
                Value::BytesValue(
                    base64::engine::general_purpose::STANDARD
                        .decode(b)
                        .unwrap_or_default(),
                )
            })
        };
        common::AnyValue { value }
    }
}

fn kvs(v: Vec<KeyValue>) -> Vec<common::KeyValue> {
    v.into_iter()
        .map(|kv| common::KeyValue {
            key: kv.key,
            value: kv.value.map(Into::into),
            key_strindex: 0,
        })
        .collect()
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ResourceJ {
    attributes: Vec<KeyValue>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Scope {
    name: String,
    version: String,
    attributes: Vec<KeyValue>,
}

fn resource(r: Option<ResourceJ>) -> Option<Resource> {
    r.map(|r| Resource {
        attributes: kvs(r.attributes),
        dropped_attributes_count: 0,
        entity_refs: vec![],
    })
}

fn scope(s: Option<Scope>) -> Option<common::InstrumentationScope> {
    s.map(|s| common::InstrumentationScope {
        name: s.name,
        version: s.version,
        attributes: kvs(s.attributes),
        dropped_attributes_count: 0,
    })
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct TracesReq {
    resource_spans: Vec<ResourceSpans>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct ResourceSpans {
    resource: Option<ResourceJ>,
    scope_spans: Vec<ScopeSpans>,
    schema_url: String,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct ScopeSpans {
    scope: Option<Scope>,
    spans: Vec<SpanJ>,
    schema_url: String,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct SpanJ {
    trace_id: Id,
    span_id: Id,
    trace_state: String,
    parent_span_id: Id,
    flags: u32,
    name: String,
    kind: Enum<SpanKindNames>,
    start_time_unix_nano: U64,
    end_time_unix_nano: U64,
    attributes: Vec<KeyValue>,
    dropped_attributes_count: u32,
    events: Vec<EventJ>,
    dropped_events_count: u32,
    dropped_links_count: u32,
    status: Option<StatusJ>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct EventJ {
    time_unix_nano: U64,
    name: String,
    attributes: Vec<KeyValue>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StatusJ {
    message: String,
    code: Enum<StatusNames>,
}

impl From<TracesReq> for ExportTraceServiceRequest {
    fn from(r: TracesReq) -> Self {
        ExportTraceServiceRequest {
            resource_spans: r
                .resource_spans
                .into_iter()
                .map(|rs| trace::ResourceSpans {
                    resource: resource(rs.resource),
                    schema_url: rs.schema_url,
                    scope_spans: rs
                        .scope_spans
                        .into_iter()
                        .map(|ss| trace::ScopeSpans {
                            scope: scope(ss.scope),
                            schema_url: ss.schema_url,
                            spans: ss.spans.into_iter().map(Into::into).collect(),
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

impl From<SpanJ> for trace::Span {
    fn from(s: SpanJ) -> Self {
        trace::Span {
            trace_id: s.trace_id.0,
            span_id: s.span_id.0,
            trace_state: s.trace_state,
            parent_span_id: s.parent_span_id.0,
            flags: s.flags,
            name: s.name,
            kind: s.kind.0,
            start_time_unix_nano: s.start_time_unix_nano.0,
            end_time_unix_nano: s.end_time_unix_nano.0,
            attributes: kvs(s.attributes),
            dropped_attributes_count: s.dropped_attributes_count,
            events: s
                .events
                .into_iter()
                .map(|e| trace::span::Event {
                    time_unix_nano: e.time_unix_nano.0,
                    name: e.name,
                    attributes: kvs(e.attributes),
                    dropped_attributes_count: 0,
                })
                .collect(),
            dropped_events_count: s.dropped_events_count,
            links: vec![],
            dropped_links_count: s.dropped_links_count,
            status: s.status.map(|st| trace::Status {
                message: st.message,
                code: st.code.0,
            }),
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct LogsReq {
    resource_logs: Vec<ResourceLogs>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct ResourceLogs {
    resource: Option<ResourceJ>,
    scope_logs: Vec<ScopeLogs>,
    schema_url: String,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct ScopeLogs {
    scope: Option<Scope>,
    log_records: Vec<LogRecordJ>,
    schema_url: String,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct LogRecordJ {
    time_unix_nano: U64,
    observed_time_unix_nano: U64,
    severity_number: Enum<SeverityNames>,
    severity_text: String,
    // The body is dropped on purpose: it may hold prompt text and no profile reads it.
    attributes: Vec<KeyValue>,
    flags: u32,
    trace_id: Id,
    span_id: Id,
    event_name: String,
}

impl From<LogsReq> for ExportLogsServiceRequest {
    fn from(r: LogsReq) -> Self {
        ExportLogsServiceRequest {
            resource_logs: r
                .resource_logs
                .into_iter()
                .map(|rl| logs::ResourceLogs {
                    resource: resource(rl.resource),
                    schema_url: rl.schema_url,
                    scope_logs: rl
                        .scope_logs
                        .into_iter()
                        .map(|sl| logs::ScopeLogs {
                            scope: scope(sl.scope),
                            schema_url: sl.schema_url,
                            log_records: sl
                                .log_records
                                .into_iter()
                                .map(|l| logs::LogRecord {
                                    time_unix_nano: l.time_unix_nano.0,
                                    observed_time_unix_nano: l.observed_time_unix_nano.0,
                                    severity_number: l.severity_number.0,
                                    severity_text: l.severity_text,
                                    body: None,
                                    attributes: kvs(l.attributes),
                                    dropped_attributes_count: 0,
                                    flags: l.flags,
                                    trace_id: l.trace_id.0,
                                    span_id: l.span_id.0,
                                    event_name: l.event_name,
                                })
                                .collect(),
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_and_base64_ids_and_enum_names() {
        let hex = r#"{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"fa084eb02ad3bbf06c3f398bd391a50a","spanId":"2cde1e06e06c4370","name":"x","kind":1,"startTimeUnixNano":5,"endTimeUnixNano":"6","status":{"code":2}}]}]}]}"#;
        let b64 = r#"{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"+ghOsCrTu/BsPzmL05GlCg==","spanId":"LN4eBuBsQ3A=","name":"x","kind":"SPAN_KIND_INTERNAL","startTimeUnixNano":"5","endTimeUnixNano":6,"status":{"code":"STATUS_CODE_ERROR"},"unknownField":[1,2]}]}]}]}"#;
        let a = decode_traces(hex.as_bytes()).unwrap();
        let b = decode_traces(b64.as_bytes()).unwrap();
        let (sa, sb) = (
            &a.resource_spans[0].scope_spans[0].spans[0],
            &b.resource_spans[0].scope_spans[0].spans[0],
        );
        assert_eq!(sa.trace_id, sb.trace_id);
        assert_eq!(sa.span_id, sb.span_id);
        assert_eq!(sa.status, sb.status);
        assert_eq!(sb.kind, 1);
        assert_eq!(sb.start_time_unix_nano, 5);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in [
            &b"{"[..],
            b"[]",
            b"{\"resourceSpans\":3}",
            b"{\"resourceSpans\":[{\"scopeSpans\":[{\"spans\":[{\"traceId\":\"zz\"}]}]}]}",
            b"\xff\xfe",
        ] {
            assert!(
                decode_traces(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(decode_traces(b"{}").unwrap().resource_spans.is_empty());
    }
}
