{{/*
Names. Component objects are "<fullname>-<component>[-metrics]": the fullname is cut to 40 characters so
every Service name stays a 63-character DNS label. A release name may not hold a dot: pod names become the
gateway's id and the workers' ids, and the gateway's id is a bus topic name ([A-Za-z0-9_-]).
*/}}
{{- define "alignedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "alignedserve.fullname" -}}
{{- if contains "." .Release.Name -}}
{{- fail (printf "release name %q holds a dot: pod names are the services' bus ids ([A-Za-z0-9_-]); pick a name without one" .Release.Name) -}}
{{- end -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "alignedserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "alignedserve.labels" -}}
helm.sh/chart: {{ include "alignedserve.chart" . }}
app.kubernetes.io/name: {{ include "alignedserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: alignedserve
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "gateway") */}}
{{- define "alignedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "alignedserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "alignedserve.componentLabels" -}}
{{ include "alignedserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The image of one role: <registry/><repository>-<role>[-cuda]:<tag>[@digest] (docker/Dockerfile targets). */}}
{{- define "alignedserve.image" -}}
{{- $img := .root.Values.image -}}
{{- $own := index $img.digests .role | default "" -}}
{{- $repo := printf "%s-%s" $img.repository .role -}}
{{- if $img.registry }}{{ $repo = printf "%s/%s" (trimSuffix "/" $img.registry) $repo }}{{ end -}}
{{- $tag := $img.tag | default .root.Chart.AppVersion -}}
{{- if $own -}}{{ printf "%s:%s@%s" $repo $tag $own }}{{- else -}}{{ printf "%s:%s" $repo $tag }}{{- end -}}
{{- end -}}

{{/* The image role of a component: prefill, decode and kvpool take the -cuda image on GPU nodes. */}}
{{- define "alignedserve.role" -}}
{{- if and .root.Values.gpu.enabled (has .component (list "prefill" "decode" "kvpool")) -}}
{{ .component }}-cuda
{{- else -}}
{{ .component }}
{{- end -}}
{{- end -}}

{{/* ---- the control bus -------------------------------------------------------------------------- */}}

{{- define "alignedserve.busHosts" -}}
{{- if .Values.bus.deploy -}}
{{ include "alignedserve.fullname" . }}-redis:6379
{{- else -}}
{{ required "bus.external.hosts is required when bus.deploy is false (host:port[,host:port])" .Values.bus.external.hosts }}
{{- end -}}
{{- end -}}

{{- define "alignedserve.busAuthDir" -}}/etc/alignedserve/bus-auth{{- end -}}
{{- define "alignedserve.busTlsDir" -}}/etc/alignedserve/bus-tls{{- end -}}

{{/* The bus URL every service reads (ALIGNEDSERVE_BUS). Secrets are files it names, never part of it. */}}
{{- define "alignedserve.busUrl" -}}
{{- $bus := .Values.bus -}}
{{- $query := list -}}
{{- range $k, $v := $bus.options }}{{ $query = append $query (printf "%s=%v" $k $v) }}{{ end -}}
{{- $auth := include "alignedserve.busAuthDir" . -}}
{{- $tls := include "alignedserve.busTlsDir" . -}}
{{- if eq $bus.type "redis" -}}
{{- if $bus.auth.enabled }}{{ $query = append $query (printf "password_file=%s/password" $auth) }}{{ end -}}
{{- if $bus.tls.enabled -}}
{{- $query = append $query (printf "ssl_ca_certs=%s/ca.crt" $tls) -}}
{{- if $bus.tls.mutual }}{{ $query = concat $query (list (printf "ssl_certfile=%s/tls.crt" $tls) (printf "ssl_keyfile=%s/tls.key" $tls)) }}{{ end -}}
{{- end -}}
{{- $user := "" -}}
{{- if and $bus.auth.enabled $bus.auth.username }}{{ $user = printf "%s@" $bus.auth.username }}{{ end -}}
{{- printf "%s://%s%s/%d" (ternary "rediss" "redis" $bus.tls.enabled) $user (include "alignedserve.busHosts" .) (int $bus.external.redisDb) -}}
{{- else -}}
{{- if and $bus.auth.enabled $bus.tls.enabled }}{{ $query = append $query "security_protocol=SASL_SSL" -}}
{{- else if $bus.auth.enabled }}{{ $query = append $query "security_protocol=SASL_PLAINTEXT" -}}
{{- else if $bus.tls.enabled }}{{ $query = append $query "security_protocol=SSL" }}{{ end -}}
{{- if $bus.auth.enabled -}}
{{- $query = append $query (printf "sasl_mechanism=%s" $bus.auth.saslMechanism) -}}
{{- $query = append $query (printf "sasl_username=%s" (required "bus.auth.username is required for Kafka SASL" $bus.auth.username)) -}}
{{- $query = append $query (printf "sasl_password_file=%s/password" $auth) -}}
{{- end -}}
{{- if $bus.tls.enabled -}}
{{- $query = append $query (printf "ssl_cafile=%s/ca.crt" $tls) -}}
{{- if $bus.tls.mutual }}{{ $query = concat $query (list (printf "ssl_certfile=%s/tls.crt" $tls) (printf "ssl_keyfile=%s/tls.key" $tls)) }}{{ end -}}
{{- end -}}
{{- printf "kafka://%s" (include "alignedserve.busHosts" .) -}}
{{- end -}}
{{- if $query }}?{{ join "&" $query }}{{ end -}}
{{- end -}}

{{- define "alignedserve.busAuthSecret" -}}
{{- .Values.bus.auth.existingSecret | default (printf "%s-bus-auth" (include "alignedserve.fullname" .)) -}}
{{- end -}}

{{- define "alignedserve.apiKeysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "alignedserve.fullname" .)) -}}
{{- end -}}

{{/* ---- the model ---------------------------------------------------------------------------------- */}}

{{- define "alignedserve.modelMount" -}}/models{{- end -}}

{{- define "alignedserve.modelPath" -}}
{{- if eq .Values.model.source "bundled" -}}
{{ .Values.model.path }}
{{- else -}}
{{ include "alignedserve.modelMount" . }}/{{ trimPrefix "/" .Values.model.path }}
{{- end -}}
{{- end -}}

{{- define "alignedserve.tokenizerPath" -}}
{{- if .Values.model.tokenizer -}}
{{ include "alignedserve.modelMount" . }}/{{ trimPrefix "/" .Values.model.tokenizer }}
{{- else -}}
{{ include "alignedserve.modelPath" . }}
{{- end -}}
{{- end -}}

{{- define "alignedserve.servedModelName" -}}
{{- .Values.model.servedName | default .Values.model.path -}}
{{- end -}}

{{/* ---- pod pieces --------------------------------------------------------------------------------- */}}

{{/* Environment every service reads: one frozen config per service (docs/configuration.md). */}}
{{- define "alignedserve.commonEnv" -}}
- name: ALIGNEDSERVE_BUS
  value: {{ include "alignedserve.busUrl" . | quote }}
- name: ALIGNEDSERVE_DEPLOYMENT   # namespaces the bus: the release's pods share it, two releases do not
  value: {{ .Release.Name | quote }}
- name: ALIGNEDSERVE_MODEL
  value: {{ include "alignedserve.modelPath" . | quote }}
- name: ALIGNEDSERVE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: ALIGNEDSERVE_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
- name: ALIGNEDSERVE_DRAIN_TIMEOUT_S
  value: {{ .Values.drainTimeoutS | quote }}
{{- end -}}

{{/* A worker's identity and ops server: (dict "root" $ "component" "prefill") */}}
{{- define "alignedserve.workerEnv" -}}
{{- $svc := upper .component -}}
- name: ALIGNEDSERVE_{{ $svc }}_WORKER_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: ALIGNEDSERVE_{{ $svc }}_METRICS_HOST
  value: "0.0.0.0"
- name: ALIGNEDSERVE_{{ $svc }}_METRICS_PORT
  value: {{ .root.Values.metricsPort | quote }}
{{- end -}}

{{/* A worker with a UCX endpoint: where peers reach it, and UCX's own settings. */}}
{{- define "alignedserve.ucxEnv" -}}
{{- $svc := upper .component -}}
{{- $ucx := .root.Values.ucx -}}
- name: ALIGNEDSERVE_{{ $svc }}_ADVERTISE_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: ALIGNEDSERVE_{{ $svc }}_TRANSFER_PORT
  value: {{ $ucx.transferPort | quote }}
- name: UCX_TLS
  value: {{ include "alignedserve.ucxTls" .root | quote }}
{{- if $ucx.netDevices }}
- name: UCX_NET_DEVICES
  value: {{ $ucx.netDevices | quote }}
{{- end }}
{{- range $k, $v := $ucx.env }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{- define "alignedserve.ucxTls" -}}
{{- if ne .Values.ucx.tls "auto" -}}
{{ .Values.ucx.tls }}
{{- else if .Values.gpu.enabled -}}
tcp,cuda_copy,cuda_ipc
{{- else -}}
tcp
{{- end -}}
{{- end -}}

{{/* The user's own variables of a component (knobs the service's config parses; others pass through). */}}
{{- define "alignedserve.extraEnv" -}}
{{- range $k, $v := .env }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{- define "alignedserve.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "alignedserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Writable paths on a read-only root filesystem: /tmp and the converted-files cache. */}}
{{- define "alignedserve.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /var/cache/alignedserve
{{- end -}}

{{- define "alignedserve.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scratch.tmpSize }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.scratch.cacheSize }}
{{- end -}}

{{- define "alignedserve.modelMounts" -}}
{{- if ne .Values.model.source "bundled" }}
- name: model
  mountPath: {{ include "alignedserve.modelMount" . }}
  readOnly: true
  {{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end -}}

{{- define "alignedserve.modelVolumes" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "image" }}
- name: model
  image:
    reference: {{ required "model.image.reference is required when model.source is image" .Values.model.image.reference }}
    pullPolicy: {{ .Values.model.image.pullPolicy }}
{{- end }}
{{- end -}}

{{- define "alignedserve.busMounts" -}}
{{- if .Values.bus.auth.enabled }}
- name: bus-auth
  mountPath: {{ include "alignedserve.busAuthDir" . }}
  readOnly: true
{{- end }}
{{- if .Values.bus.tls.enabled }}
- name: bus-tls
  mountPath: {{ include "alignedserve.busTlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "alignedserve.busVolumes" -}}
{{- if .Values.bus.auth.enabled }}
- name: bus-auth
  secret:
    secretName: {{ include "alignedserve.busAuthSecret" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.bus.auth.passwordKey }}
        path: password
{{- end }}
{{- if .Values.bus.tls.enabled }}
- name: bus-tls
  secret:
    secretName: {{ required "bus.tls.existingSecret is required when bus.tls.enabled (keys ca.crt, and tls.crt / tls.key for mutual TLS)" .Values.bus.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* Scheduling of a component: its own nodeSelector / tolerations / affinity win over the global ones. */}}
{{- define "alignedserve.scheduling" -}}
{{- $c := .values -}}
{{- $root := .root -}}
{{- $nodeSelector := merge (deepCopy ($c.nodeSelector | default dict)) ($root.Values.nodeSelector | default dict) -}}
{{- if and $root.Values.gpu.enabled (has .component (list "prefill" "decode")) -}}
{{- $nodeSelector = merge $nodeSelector ($root.Values.gpu.nodeSelector | default dict) -}}
{{- end -}}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := concat ($root.Values.tolerations | default list) ($c.tolerations | default list) -}}
{{- if and $root.Values.gpu.enabled (has .component (list "prefill" "decode")) -}}
{{- $tolerations = concat $tolerations ($root.Values.gpu.tolerations | default list) -}}
{{- end -}}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $affinity := deepCopy ($c.affinity | default ($root.Values.affinity | default dict)) -}}
{{- if and $root.Values.gpu.enabled $root.Values.gpu.nvlink.enabled (has .component (list "prefill" "decode")) -}}
{{- $peer := ternary "prefill" "decode" (eq .component "decode") -}}
{{- $term := dict "labelSelector" (dict "matchLabels" (fromYaml (include "alignedserve.selectorLabels" (dict "root" $root "component" $peer)))) "topologyKey" $root.Values.gpu.nvlink.topologyKey -}}
{{- $pa := dict -}}
{{- if eq .component "decode" -}}
{{- $pa = dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term) -}}
{{- else -}}
{{- $pa = dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term)) -}}
{{- end -}}
{{- $_ := set $affinity "podAffinity" (merge $pa (get $affinity "podAffinity" | default dict)) -}}
{{- $na := dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" (list (dict "matchExpressions" (list (dict "key" $root.Values.gpu.nvlink.topologyKey "operator" "Exists"))))) -}}
{{- if not (hasKey $affinity "nodeAffinity") }}{{ $_ := set $affinity "nodeAffinity" $na }}{{ end -}}
{{- end -}}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($c.topologySpreadConstraints | default $root.Values.topologySpreadConstraints) }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{- define "alignedserve.imagePullSecrets" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Probes on the ops port: startup (model load), readiness (/ready), liveness (/health). */}}
{{- define "alignedserve.probes" -}}
{{- $p := .probes -}}
startupProbe:
  httpGet:
    path: {{ .startupPath }}
    port: {{ .port }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
readinessProbe:
  httpGet:
    path: /ready
    port: {{ .port }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
livenessProbe:
  httpGet:
    path: /health
    port: {{ .port }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
{{- end -}}

{{- define "alignedserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ .Values.serviceAccount.name | default (include "alignedserve.fullname" .) }}
{{- else -}}
{{ .Values.serviceAccount.name | default "default" }}
{{- end -}}
{{- end -}}
