
ƒ#
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
0.32.1ú!

smg¦

÷eÍCÝ„Hë!€1œ#,oÚí’"·­kqi 31*http_request09Ô|4AíA|+0|4AíJ;
code.file.path)
'model_gateway/src/middleware/logging.rsJ.
code.module.name
smg::middleware::loggingJ
code.line.numberVJ
	thread.idJ 
thread.name
tokio-rt-workerJ
target
smg::otel-traceJ
method
POSTJ
path
	/generateJ
version

HTTP/1.1J
module
smgJ.
trace_id"
 0af7651916cd43dd8448eb211c80319cJ

request_id
rej-1J
status_code
400J
latency
1337J
busy_ns€Ê9J
idle_nsÈÞZ¹	(ð$|4AíSending concurrent requests
level
INFO&
target
smg::observability::events'
prefill_url
http://127.0.0.1:36591&

decode_url
http://127.0.0.1:46535=
code.file.path+
)model_gateway/src/observability/events.rs0
code.module.name
smg::observability::events
code.line.numberZé	"¢.|4AíReceived concurrent requests
level
INFO&
target
smg::observability::events=
code.file.path+
)model_gateway/src/observability/events.rs0
code.module.name
smg::observability::events
code.line.numberGÇ
ÆtíH¤ôä0E©>äƒsú_1>!lÙ*http_request09õ·É9AíAlÆ‹â9AíJ;
code.file.path)
'model_gateway/src/middleware/logging.rsJ.
code.module.name
smg::middleware::loggingJ
code.line.numberVJ
	thread.idJ 
thread.name
tokio-rt-workerJ
target
smg::otel-traceJ
method
POSTJ
path
	/generateJ
version

HTTP/1.1J
module
smgJ.
trace_id"
 c674ed48a48ff4e4304590a93ee48373J

request_id	
storm-1J
status_code
503J
latency
416535J
busy_ns ÂÿJ
idle_ns±¹ÓÄZ¹	JÒ¿É9AíSending concurrent requests
level
INFO&
target
smg::observability::events'
prefill_url
http://127.0.0.1:45093&

decode_url
http://127.0.0.1:41497=
code.file.path+
)model_gateway/src/observability/events.rs0
code.module.name
smg::observability::events
code.line.numberZé	UvËÉ9AíReceived concurrent requests
level
INFO&
target
smg::observability::events=
code.file.path+
)model_gateway/src/observability/events.rs0
code.module.name
smg::observability::events
code.line.numberGZ¹	Ð{Ì9AíSending concurrent requests
level
INFO&
target
smg::observability::events'
prefill_url
http://127.0.0.1:45093&

decode_url
http://127.0.0.1:41497=
code.file.path+
)model_gateway/src/observability/events.rs0
code.module.name
smg::observability::events
code.line.numberZé	ü<ˆÌ9AíReceived concurrent requests
level
INFO&
target
smg::observability::events=
code.file.path+
)model_gateway/src/observability/events.rs0
code.module.name
smg::observability::events
code.line.numberGZ¹	jvÿÑ9AíSending concurrent requests
level
INFO&
target
smg::observability::events'
prefill_url
http://127.0.0.1:45093&

decode_url
http://127.0.0.1:41497=
code.file.path+
)model_gateway/src/observability/events.rs0
code.module.name
smg::observability::events
code.line.numberZé	A
Ò9AíReceived concurrent requests
level
INFO&
target
smg::observability::events=
code.file.path+
)model_gateway/src/observability/events.rs0
code.module.name
smg::observability::events
code.line.numberGZ¹	OÕ
Ø9AíSending concurrent requests
level
INFO&
target
smg::observability::events'
prefill_url
http://127.0.0.1:45093&

decode_url
http://127.0.0.1:41497=
code.file.path+
)model_gateway/src/observability/events.rs0
code.module.name
smg::observability::events
code.line.numberZé	ižØ9AíReceived concurrent requests
level
INFO&
target
smg::observability::events=
code.file.path+
)model_gateway/src/observability/events.rs0
code.module.name
smg::observability::events
code.line.numberGZ¹	¸¯}â9AíSending concurrent requests
level
INFO&
target
smg::observability::events'
prefill_url
http://127.0.0.1:45093&

decode_url
http://127.0.0.1:41497=
code.file.path+
)model_gateway/src/observability/events.rs0
code.module.name
smg::observability::events
code.line.numberZé	p5Šâ9AíReceived concurrent requests
level
INFO&
target
smg::observability::events=
code.file.path+
)model_gateway/src/observability/events.rs0
code.module.name
smg::observability::events
code.line.numberGz