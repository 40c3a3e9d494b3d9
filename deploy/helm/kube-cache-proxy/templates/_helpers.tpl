{{- define "kcp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kcp.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kcp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kcp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kcp.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kcp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kcp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kcp.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The TCP port of an http(s) URL: its own, else the scheme's (80, 443). */}}
{{- define "kcp.urlPort" -}}
{{- $u := urlParse . -}}
{{- $hostPort := splitList ":" $u.host -}}
{{- if gt (len $hostPort) 1 -}}
{{- last $hostPort -}}
{{- else if eq $u.scheme "https" -}}
443
{{- else -}}
80
{{- end -}}
{{- end -}}

{{- define "kcp.tlsSecretName" -}}
{{- if .Values.tls.certManager.enabled -}}
{{- printf "%s-tls" (include "kcp.fullname" .) -}}
{{- else -}}
{{- required "tls.existingSecret (or tls.certManager.enabled) is required" .Values.tls.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* The cached resources grouped by API group: {"": [pods, ...], "apps": [...]}. */}}
{{- define "kcp.resourcesByGroup" -}}
{{- $groups := dict -}}
{{- range without .Values.cache.resources "all" -}}
{{- $parts := splitn "." 2 . -}}
{{- $grp := default "" $parts._1 -}}
{{- $list := list -}}
{{- if hasKey $groups $grp -}}{{- $list = get $groups $grp -}}{{- end -}}
{{- $_ := set $groups $grp (append $list $parts._0) -}}
{{- end -}}
{{- toJson $groups -}}
{{- end -}}

{{/* The proxy's configuration file (YAML), validated by `kube-cache-proxy check-config`. */}}
{{- define "kcp.config" -}}
{{- $tls := dict "certFile" "/etc/kube-cache-proxy/tls/tls.crt" "keyFile" "/etc/kube-cache-proxy/tls/tls.key" -}}
{{- if .Values.tls.clientCAConfigMap -}}
{{- $_ := set $tls "clientCaFile" "/etc/kube-cache-proxy/client-ca/ca.crt" -}}
{{- end -}}
{{- $cfg := dict
  "listen" "0.0.0.0:8443"
  "tls" $tls
  "server" (dict "adminListen" (printf "0.0.0.0:%d" (int .Values.admin.port)) "adminAuth" .Values.admin.auth)
  "upstream" (dict "kubeconfig" nil)
  "shutdown" (dict "delay" (printf "%ds" (int .Values.shutdown.delaySeconds)) "drainTimeout" (printf "%ds" (int .Values.shutdown.drainTimeoutSeconds)))
  "cache" (dict "resources" .Values.cache.resources)
  "log" (dict "level" .Values.log.level "format" .Values.log.format)
-}}
{{- if .Values.cache.stateSizeLimit -}}
{{- $_ := set $cfg.cache "stateDir" "/var/lib/kube-cache-proxy" -}}
{{- end -}}
{{- if .Values.tenants -}}
{{- $_ := set $cfg "tenants" .Values.tenants -}}
{{- end -}}
{{- if .Values.tracing.endpoint -}}
{{- $_ := set $cfg "tracing" (dict "otlp" (dict "endpoint" .Values.tracing.endpoint) "samplingRatio" (float64 .Values.tracing.samplingRatio)) -}}
{{- end -}}
{{- $_ := set $cfg "tokens" (dict "keyFile" (printf "/etc/kube-cache-proxy/tokens/%s" .Values.tokens.keyFile)) -}}
{{- $cfg = mergeOverwrite $cfg (deepCopy .Values.config) -}}
{{- toYaml $cfg -}}
{{- end -}}
