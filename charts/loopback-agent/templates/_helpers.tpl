{{/* Labels of every object: as the kustomize base's, managed by Helm */}}
{{- define "loopback-agent.common" -}}
app.kubernetes.io/part-of: loopback-agent
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "loopback-agent.agentLabels" -}}
app.kubernetes.io/name: loopback-agent
app.kubernetes.io/component: agent
{{- end }}

{{- define "loopback-agent.collectorLabels" -}}
app.kubernetes.io/name: loopback-agent
app.kubernetes.io/component: collector
{{- end }}

{{- define "loopback-agent.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}

{{- define "loopback-agent.collectorURL" -}}
{{- if .Values.collector.enabled -}}
{{ ternary "https" "http" .Values.tls.enabled }}://loopback-agent-collector.{{ .Values.namespaces.collector }}.svc:{{ .Values.collector.port }}
{{- else -}}
{{ .Values.collector.url }}
{{- end -}}
{{- end }}

{{- define "loopback-agent.validate" -}}
{{- if not (has .Values.auth.mode (list "shared-token" "kube-token")) -}}
{{- fail "auth.mode must be shared-token or kube-token" -}}
{{- end -}}
{{- if and (gt (int .Values.collector.replicas) 1) (hasPrefix "sqlite:" .Values.collector.db) -}}
{{- fail "collector.replicas > 1 needs a PostgreSQL collector.db (SQLite has one writer)" -}}
{{- end -}}
{{- end }}
