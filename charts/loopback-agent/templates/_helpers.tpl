{{/* The chart's name, or nameOverride */}}
{{- define "loopback-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The agents' objects' name: fullnameOverride, else the release name when it contains the
chart's name, else RELEASE-NAME. 63 characters at most (a Service's name is a DNS label).
*/}}
{{- define "loopback-agent.fullname" -}}
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

{{/* The collector's objects' name: FULLNAME-collector */}}
{{- define "loopback-agent.collector.fullname" -}}
{{- printf "%s-collector" (include "loopback-agent.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loopback-agent.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The agents' namespace: namespaceOverride, else the release's */}}
{{- define "loopback-agent.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride }}
{{- end }}

{{/* The collector's namespace: collector.namespaceOverride, else the agents' */}}
{{- define "loopback-agent.collector.namespace" -}}
{{- default (include "loopback-agent.namespace" .) .Values.collector.namespaceOverride }}
{{- end }}

{{/* Where the PrometheusRule (and by default the dashboard) go: with the collector */}}
{{- define "loopback-agent.monitoring.namespace" -}}
{{- if .Values.collector.enabled }}
{{- include "loopback-agent.collector.namespace" . }}
{{- else }}
{{- include "loopback-agent.namespace" . }}
{{- end }}
{{- end }}

{{/* Labels of every object */}}
{{- define "loopback-agent.commonLabels" -}}
helm.sh/chart: {{ include "loopback-agent.chart" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: {{ include "loopback-agent.name" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels: (dict "ctx" $ "component" "agent"|"collector") */}}
{{- define "loopback-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loopback-agent.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* An object's labels: its component's selector labels and the common ones */}}
{{- define "loopback-agent.labels" -}}
app.kubernetes.io/name: {{ include "loopback-agent.name" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{ include "loopback-agent.commonLabels" .ctx }}
{{- end }}

{{- define "loopback-agent.agent.selectorLabels" -}}
{{ include "loopback-agent.selectorLabels" (dict "ctx" . "component" "agent") }}
{{- end }}

{{- define "loopback-agent.agent.labels" -}}
{{ include "loopback-agent.labels" (dict "ctx" . "component" "agent") }}
{{- end }}

{{- define "loopback-agent.collector.selectorLabels" -}}
{{ include "loopback-agent.selectorLabels" (dict "ctx" . "component" "collector") }}
{{- end }}

{{- define "loopback-agent.collector.labels" -}}
{{ include "loopback-agent.labels" (dict "ctx" . "component" "collector") }}
{{- end }}

{{/* The agents' scrape endpoint, an item of a PodMonitor's or ServiceMonitor's list */}}
{{- define "loopback-agent.agent.endpoint" -}}
- port: metrics
  path: /metrics
  # the agent's series change once per verdict (60 s by default)
  interval: 30s
  # the alerts group by node
  relabelings:
    - sourceLabels: [__meta_kubernetes_pod_node_name]
      targetLabel: node
{{- end }}

{{/* The collector's scrape endpoint, an item of a PodMonitor's or ServiceMonitor's list */}}
{{- define "loopback-agent.collector.endpoint" -}}
- port: http
  path: /metrics
  interval: 30s
  {{- if .Values.tls.enabled }}
  scheme: https
  # the CA ConfigMap must also exist in the collector's namespace for this
  tlsConfig:
    serverName: {{ include "loopback-agent.collector.host" . }}
    ca:
      configMap:
        name: {{ include "loopback-agent.tls.caConfigMap" . }}
        key: ca.crt
  {{- end }}
  # the collector's per-node series carry their own node label, which must stay
  honorLabels: true
{{- end }}

{{/* A pod's labels: podLabels, under the selector's (which win) */}}
{{- define "loopback-agent.podLabels" -}}
{{- $selector := include "loopback-agent.selectorLabels" (dict "ctx" .ctx "component" .component) | fromYaml }}
{{- toYaml (mustMergeOverwrite (deepCopy (.podLabels | default dict)) $selector) }}
{{- end }}

{{- define "loopback-agent.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (include "loopback-agent.fullname" .) .Values.agent.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "loopback-agent.collector.serviceAccountName" -}}
{{- if .Values.collector.serviceAccount.create }}
{{- default (include "loopback-agent.collector.fullname" .) .Values.collector.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.collector.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The shared-token Secret (auth.existingSecret, else FULLNAME-token) */}}
{{- define "loopback-agent.tokenSecret" -}}
{{- default (printf "%s-token" (include "loopback-agent.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/*
The shared token's volume source, the key as the file "token":
(dict "ctx" $ "mode" "0400" "optional" true|false)
*/}}
{{- define "loopback-agent.tokenVolume" -}}
secret:
  secretName: {{ include "loopback-agent.tokenSecret" .ctx }}
  {{- if ne .ctx.Values.auth.existingSecretKey "token" }}
  items:
    - key: {{ .ctx.Values.auth.existingSecretKey }}
      path: token
  {{- end }}
  defaultMode: {{ .mode }}
  {{- if .optional }}
  optional: true
  {{- end }}
{{- end }}

{{- define "loopback-agent.tls.secretName" -}}
{{- default (printf "%s-tls" (include "loopback-agent.collector.fullname" .)) .Values.tls.secretName }}
{{- end }}

{{- define "loopback-agent.tls.caConfigMap" -}}
{{- default (printf "%s-ca" (include "loopback-agent.collector.fullname" .)) .Values.tls.caConfigMap }}
{{- end }}

{{/* The collector's DNS name, the one its certificate must carry */}}
{{- define "loopback-agent.collector.host" -}}
{{- printf "%s.%s.svc" (include "loopback-agent.collector.fullname" .) (include "loopback-agent.collector.namespace" .) }}
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
{{ ternary "https" "http" .Values.tls.enabled }}://{{ include "loopback-agent.collector.host" . }}:{{ .Values.collector.port }}
{{- else -}}
{{ .Values.collector.url }}
{{- end -}}
{{- end }}

{{- define "loopback-agent.collector.sqlite" -}}
{{- if hasPrefix "sqlite:" .Values.collector.db }}true{{ end }}
{{- end }}

{{/* What the schema cannot say */}}
{{- define "loopback-agent.validate" -}}
{{- $sqlite := include "loopback-agent.collector.sqlite" . }}
{{- if and .Values.collector.enabled $sqlite }}
{{- if gt (int .Values.collector.replicas) 1 }}
{{- fail "collector.replicas > 1 needs a PostgreSQL collector.db (SQLite has one writer)" }}
{{- end }}
{{- if eq ((.Values.collector.updateStrategy | default dict).type | default "") "RollingUpdate" }}
{{- fail "collector.updateStrategy RollingUpdate needs a PostgreSQL collector.db (SQLite on a ReadWriteOnce volume has one writer: Recreate)" }}
{{- end }}
{{- end }}
{{- if and .Values.monitoring.podMonitor.enabled .Values.monitoring.serviceMonitor.enabled }}
{{- fail "monitoring.podMonitor and monitoring.serviceMonitor scrape the same pods: enable one (else every series is there twice)" }}
{{- end }}
{{- end }}
