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

{{- define "revenant.selectorLabels" -}}
app.kubernetes.io/name: {{ include "revenant.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: node-agent
{{- end }}

{{- define "revenant.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "revenant.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: revenant
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
