{{/* Chart name, truncated to the 63 characters a label value may hold. */}}
{{- define "revenant.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified name: the release name, with the chart's when it does not contain it. */}}
{{- define "revenant.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The release's pods, whatever their component. */}}
{{- define "revenant.instanceLabels" -}}
app.kubernetes.io/name: {{ include "revenant.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "revenant.selectorLabels" -}}
{{ include "revenant.instanceLabels" . }}
app.kubernetes.io/component: node-agent
{{- end }}

{{/* Cluster mode's checker tier and NATS. */}}
{{- define "revenant.checkerSelectorLabels" -}}
{{ include "revenant.instanceLabels" . }}
app.kubernetes.io/component: checker
{{- end }}

{{- define "revenant.natsSelectorLabels" -}}
{{ include "revenant.instanceLabels" . }}
app.kubernetes.io/component: nats
{{- end }}

{{/* Every object's labels: the chart, its component's selector labels, version and owner. */}}
{{- define "revenant.labelsWith" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include .selector .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: revenant
{{- end }}

{{- define "revenant.labels" -}}
{{ include "revenant.labelsWith" (dict "root" . "selector" "revenant.selectorLabels") }}
{{- end }}

{{- define "revenant.checkerLabels" -}}
{{ include "revenant.labelsWith" (dict "root" . "selector" "revenant.checkerSelectorLabels") }}
{{- end }}

{{- define "revenant.natsLabels" -}}
{{ include "revenant.labelsWith" (dict "root" . "selector" "revenant.natsSelectorLabels") }}
{{- end }}

{{/* mode: all-in-one (one `revenant run` per node) or cluster (agents, checkers, NATS). */}}
{{- define "revenant.cluster" -}}
{{- if eq .Values.mode "cluster" }}true
{{- else if ne .Values.mode "all-in-one" }}{{ fail (printf "mode must be all-in-one or cluster, not %q" .Values.mode) }}
{{- end }}
{{- end }}

{{/* Whether the chart runs NATS itself: cluster mode without bus.natsUrl. */}}
{{- define "revenant.natsInChart" -}}
{{- if and (include "revenant.cluster" .) (not .Values.bus.natsUrl) }}true{{ end }}
{{- end }}

{{/* The --nats URLs: bus.natsUrl, or every server of the chart's NATS by its stable name. */}}
{{- define "revenant.natsUrls" -}}
{{- if .Values.bus.natsUrl }}
{{- .Values.bus.natsUrl }}
{{- else }}
{{- $name := printf "%s-nats" (include "revenant.fullname" .) }}
{{- $urls := list }}
{{- range $i := until (int .Values.nats.replicas) }}
{{- $urls = append $urls (printf "nats://%s-%d.%s.%s.svc:%v" $name $i $name $.Release.Namespace $.Values.nats.clientPort) }}
{{- end }}
{{- join "," $urls }}
{{- end }}
{{- end }}

{{/* Stream replicas: bus.streamReplicas, else 3 on the chart's three-server NATS, else 1. */}}
{{- define "revenant.streamReplicas" -}}
{{- if .Values.bus.streamReplicas }}{{ .Values.bus.streamReplicas }}
{{- else if and (include "revenant.natsInChart" .) (ge (int .Values.nats.replicas) 3) }}3
{{- else }}1
{{- end }}
{{- end }}

{{/* The bus flags agent and checker share; the stream records the partition count. */}}
{{- define "revenant.busArgs" -}}
- --nats={{ include "revenant.natsUrls" . }}
- --stream={{ .Values.bus.stream }}
- --partitions={{ .Values.bus.partitions }}
- --replicas={{ include "revenant.streamReplicas" . }}
- --retention={{ .Values.bus.retention }}
{{- end }}


{{- define "revenant.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "revenant.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "revenant.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Whether the pod loads eBPF probes (and so runs as uid 0 with the capabilities, hostPID). */}}
{{- define "revenant.ebpf" -}}
{{- if ne (include "revenant.ebpfMode" .) "off" }}true{{ end }}
{{- end }}

{{- define "revenant.alertSecretName" -}}
{{- default (printf "%s-alerts" (include "revenant.fullname" .)) .Values.alerts.existingSecret }}
{{- end }}

{{/* The shipped alert rules with their job label set to serviceMonitor.jobLabel. */}}
{{- define "revenant.alertRules" -}}
{{- .Files.Get "files/revenant-alerts.yaml" | replace "job=\"revenant\"" (printf "job=%q" .Values.serviceMonitor.jobLabel) }}
{{- end }}

{{/* ebpf.mode as revenant takes it; YAML 1.1 reads a bare on/off as a boolean. */}}
{{- define "revenant.ebpfMode" -}}
{{- $m := toString .Values.ebpf.mode }}
{{- if eq $m "true" }}on{{ else if eq $m "false" }}off
{{- else if has $m (list "on" "off" "auto") }}{{ $m }}
{{- else }}{{ fail (printf "ebpf.mode must be on, off or auto, not %q" $m) }}
{{- end }}
{{- end }}

{{/* TLS or a token on the servers: probes and scraping then use the plain metrics port. */}}
{{- define "revenant.access" -}}
{{- if or .Values.tls.secretName .Values.auth.tokenSecretName }}true{{- end }}
{{- end }}

{{/* The scheme of the admin port. */}}
{{- define "revenant.adminScheme" -}}
{{- if .Values.tls.secretName }}https{{ else }}http{{ end }}
{{- end }}

{{/* The port probes and Prometheus use: `metrics` when access control is on, else `admin`. */}}
{{- define "revenant.opsPort" -}}
{{- if include "revenant.access" . }}metrics{{ else }}admin{{ end }}
{{- end }}

{{/* Flags of TLS, the token and the metrics port (agents and checkers alike). */}}
{{- define "revenant.accessArgs" -}}
{{- if .Values.tls.secretName }}
- --tls-cert=/etc/revenant/tls/tls.crt
- --tls-key=/etc/revenant/tls/tls.key
{{- if .Values.tls.requireClientCert }}
- --tls-client-ca=/etc/revenant/tls/ca.crt
{{- end }}
{{- end }}
{{- if .Values.auth.tokenSecretName }}
- --auth-token-file=/etc/revenant/token/token
{{- end }}
{{- if include "revenant.access" . }}
- --metrics-addr=0.0.0.0:{{ .Values.admin.metricsPort }}
{{- end }}
{{- end }}

{{/* Mounted whole (no subPath), so the kubelet's updates of a rotated Secret reach the files
revenant re-reads. */}}
{{- define "revenant.accessMounts" -}}
{{- if .Values.tls.secretName }}
- name: tls
  mountPath: /etc/revenant/tls
  readOnly: true
{{- end }}
{{- if .Values.auth.tokenSecretName }}
- name: auth-token
  mountPath: /etc/revenant/token
  readOnly: true
{{- end }}
{{- end }}

{{- define "revenant.accessVolumes" -}}
{{- if .Values.tls.secretName }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if .Values.auth.tokenSecretName }}
- name: auth-token
  secret:
    secretName: {{ .Values.auth.tokenSecretName }}
    defaultMode: 0440
    items:
      - key: {{ .Values.auth.tokenSecretKey }}
        path: token
{{- end }}
{{- end }}

{{/* The metrics container port, when access control is on. */}}
{{- define "revenant.metricsContainerPort" -}}
{{- if include "revenant.access" . }}
- name: metrics
  containerPort: {{ .Values.admin.metricsPort }}
  protocol: TCP
{{- end }}
{{- end }}
