
ú
ƒ

service.name
smg
 
telemetry.sdk.language
rust
%
telemetry.sdk.name
opentelemetry
!
telemetry.sdk.version
0.27.1ñ

smgç
úN°*Ó»ðl?9‹Ó‘¥
,ÞàlCp*http_request09£@/™y ìAíÜE™y ìJD
code.filepath3
1/home/runner/work/sglang/sglang/src/middleware.rsJ#
code.namespace
smg::middlewareJ
code.lineno”J
	thread.idJ%
thread.name
tokio-runtime-workerJ
method
POSTJ
uri
	/generateJ
version

HTTP/1.1J
module
smgJ

request_id
traced-rej2J
status_code
400J
latency
1470J
busy_ns¦øJ
idle_nsÒÌEZÃ	õ}2™y ìSending concurrent requests
level
INFO&
target
smg::observability::events'
prefill_url
http://127.0.0.1:31001&

decode_url
http://127.0.0.1:31002N
code.filepath=
;/home/runner/work/sglang/sglang/src/observability/events.rs.
code.namespace
smg::observability::events
code.linenoZó	oD™y ìReceived concurrent requests
level
INFO&
target
smg::observability::eventsN
code.filepath=
;/home/runner/work/sglang/sglang/src/observability/events.rs.
code.namespace
smg::observability::events
code.linenoG