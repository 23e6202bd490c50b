
ä
Ë
!
service.instance.id

pid-1139

service.name
vllm-router

service.version
0.1.17
 
telemetry.sdk.language
rust
%
telemetry.sdk.name
opentelemetry
!
telemetry.sdk.version
0.27.1“

vllm-router¾
B»*ïy«i—NÌŞĞ$EbåÄ¦%Wf*POST /v1/completions09ísâ¼GZíAm:ş¼GZíJ$
code.filepath
src/middleware.rsJ.
code.namespace
vllm_router_rs::middlewareJ
code.lineno¥J
	thread.idJ 
thread.name
tokio-rt-workerJ
http.request.method
POSTJ
url.path
/v1/completionsJ

http.route
/v1/completionsJ

request_id
client-ok-1J"
http.response.status_code
200J

latency_ms	!>˜ŸPı?J
busy_ns¡¹!J
idle_nsÔåMı
B»*ïy«i—NÌŞĞ$Eb…°ĞÏ+"åÄ¦%Wf*POST /v1/completions09gæ¼GZíA¼õ¼GZíJ#
code.filepath
src/otel_http.rsJ-
code.namespace
vllm_router_rs::otel_httpJ
code.linenoBJ
	thread.idJ 
thread.name
tokio-rt-workerJ
http.request.method
POSTJ3
url.full'
%http://127.0.0.1:44099/v1/completionsJ

http.route
/v1/completionsJ
vllm.request_phase	
prefillJ
server.address
	127.0.0.1J
server.port
44099J"
http.response.status_code
200J
busy_nsııJ
idle_nséİ6ü
B»*ïy«i—NÌŞĞ$EbÍ4(Vä~”"åÄ¦%Wf*POST /v1/completions09‡±÷¼GZíA(ı¼GZíJ#
code.filepath
src/otel_http.rsJ-
code.namespace
vllm_router_rs::otel_httpJ
code.linenoBJ
	thread.idJ 
thread.name
tokio-rt-workerJ
http.request.method
POSTJ3
url.full'
%http://127.0.0.1:44491/v1/completionsJ

http.route
/v1/completionsJ
vllm.request_phase
decodeJ
server.address
	127.0.0.1J
server.port
44491J"
http.response.status_code
200J
busy_nsŠşJ
idle_nsÅöÀ
‘ÿ„Yïp¿ƒ§ŞÆİ0øbæÁw .|T!*POST /v1/completions09±Å½GZíAâ„•¿GZíJ$
code.filepath
src/middleware.rsJ.
code.namespace
vllm_router_rs::middlewareJ
code.lineno¥J
	thread.idJ 
thread.name
tokio-rt-workerJ
http.request.method
POSTJ
url.path
/v1/completionsJ

http.route
/v1/completionsJ

request_id
client-rej-1J"
http.response.status_code
400J

latency_ms	!,~SX©^E@J
busy_nsì¦J
idle_nsÕåªş
‘ÿ„Yïp¿ƒ§ŞÆİ0øbu|l{Š°Š"æÁw .|T!*POST /v1/completions09Ts	½GZíA¶r¢¿GZíJ#
code.filepath
src/otel_http.rsJ-
code.namespace
vllm_router_rs::otel_httpJ
code.linenoBJ
	thread.idJ 
thread.name
tokio-rt-workerJ
http.request.method
POSTJ3
url.full'
%http://127.0.0.1:44099/v1/completionsJ

http.route
/v1/completionsJ
vllm.request_phase	
prefillJ
server.address
	127.0.0.1J
server.port
44099J"
http.response.status_code
400J
busy_nsûâJ
idle_nsï¤á