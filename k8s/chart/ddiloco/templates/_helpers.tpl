{{/*
Chart name, truncated to 63 characters (the limit of a DNS label).
*/}}
{{- define "ddiloco.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name prefix of every resource: <release>-<chart>, or the release name when it already
contains the chart name. Truncated so that "<fullname>-evaluator" still fits in 63 characters.
*/}}
{{- define "ddiloco.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ddiloco.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every resource.
*/}}
{{- define "ddiloco.labels" -}}
helm.sh/chart: {{ include "ddiloco.chart" . }}
{{ include "ddiloco.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ddiloco
{{- end }}

{{- define "ddiloco.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ddiloco.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels and selector labels of one component: (dict "ctx" $ "component" "syncer").
*/}}
{{- define "ddiloco.componentLabels" -}}
{{ include "ddiloco.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "ddiloco.componentSelectorLabels" -}}
{{ include "ddiloco.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "ddiloco.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "ddiloco.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ddiloco.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Refuses plaintext on a path that leaves the release (and so, as far as the chart can tell, the
cluster): (dict "ctx" $ "what" "<the path>"). Across regions gRPC in plaintext carries the model's
parameters and the learners' uploads unencrypted, and nobody's identity is checked (any address
that reaches the port can upload as any learner). tls.allowPlaintextBeyondCluster is the explicit
opt-in for a private interconnect the operator trusts instead.
*/}}
{{- define "ddiloco.refusePlaintext" -}}
{{- if not (or .ctx.Values.tls.enabled .ctx.Values.tls.allowPlaintextBeyondCluster) }}
{{- fail (printf "refusing plaintext beyond the cluster: %s, but tls.enabled is false, so that traffic (model parameters, learner uploads) would be unencrypted and unauthenticated. Set tls.enabled=true with tls.existingSecret (see k8s/README.md), or, only over a private interconnect you trust, tls.allowPlaintextBeyondCluster=true" .what) }}
{{- end }}
{{- end }}

{{/*
host:port of the syncer as this release's learners and evaluator reach it: hub.syncerAddress, or
the in-cluster Service of this release's syncer.
*/}}
{{- define "ddiloco.syncerAddress" -}}
{{- if .Values.hub.syncerAddress }}
{{- include "ddiloco.refusePlaintext" (dict "ctx" . "what" (printf "hub.syncerAddress=%s is a syncer outside this release, which learners, the evaluator and `helm test` dial" .Values.hub.syncerAddress)) }}
{{- .Values.hub.syncerAddress }}
{{- else if .Values.syncer.enabled }}
{{- printf "%s-syncer:%d" (include "ddiloco.fullname" .) (int .Values.syncer.port) }}
{{- else }}
{{- fail "hub.syncerAddress is empty and syncer.enabled is false: set hub.syncerAddress to the hub syncer's host:port (e.g. syncer.hub.example.com:50051)" }}
{{- end }}
{{- end }}

{{/*
host:port of the checkpoint store(s) as the syncer reaches them: the stable DNS names of the
store's pods behind its headless Service (a comma list with store.replicas > 1), or
syncer.checkpointTarget.
*/}}
{{- define "ddiloco.checkpointTarget" -}}
{{- if .Values.syncer.checkpointTarget }}
{{- include "ddiloco.refusePlaintext" (dict "ctx" . "what" (printf "syncer.checkpointTarget=%s is a checkpoint store outside this release, which the syncer sends every checkpoint" .Values.syncer.checkpointTarget)) }}
{{- .Values.syncer.checkpointTarget }}
{{- else if .Values.store.enabled }}
{{- $store := printf "%s-store" (include "ddiloco.fullname" .) }}
{{- $targets := list }}
{{- range $i := until (int (.Values.store.replicas | default 1)) }}
{{- $targets = append $targets (printf "%s-%d.%s:%d" $store $i $store (int $.Values.store.port)) }}
{{- end }}
{{- join "," $targets }}
{{- else }}
{{- fail "the syncer needs a checkpoint store: set store.enabled=true or syncer.checkpointTarget" }}
{{- end }}
{{- end }}

{{/*
An environment value from values: whole numbers are printed as integers (Helm reads every YAML
number as a float, which would print 25165824 as 2.5165824e+07), booleans as true/false.
*/}}
{{- define "ddiloco.envValue" -}}
{{- if kindIs "float64" . }}
{{- if eq (floor .) . }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else }}
{{- . }}
{{- end }}
{{- end }}

{{/*
ConfigMap data from a settings map: (dict "prefix" "DDILOCO_SYNCER_" "settings" .Values.syncer.settings).
camelCase keys become the service's environment variables (checkpointEveryMerges ->
DDILOCO_SYNCER_CHECKPOINT_EVERY_MERGES).
*/}}
{{- define "ddiloco.settingsData" -}}
{{- $prefix := .prefix }}
{{- range $key := keys .settings | sortAlpha }}
{{ printf "%s%s" $prefix ($key | snakecase | upper) }}: {{ include "ddiloco.envValue" (get $.settings $key) | quote }}
{{- end }}
{{- end }}

{{/*
Transport security of one component, as ConfigMap data:
(dict "ctx" $ "prefix" "DDILOCO_SYNCER_" "identity" "syncer" "serverName" "" "healthPort" 8081).
With tls.enabled: mutual TLS with the CA and the component's own certificate and key from
tls.mountPath (learners: per pod, set in their StatefulSet, so no identity here), the name expected
in the peer's certificate, and a plaintext port serving only the health service, for the probes.
Otherwise plaintext, asked for explicitly (the services refuse to start without a choice).
*/}}
{{- define "ddiloco.transport" -}}
{{- $tls := .ctx.Values.tls -}}
{{- if $tls.enabled -}}
{{- if not $tls.existingSecret -}}
{{- fail "tls.enabled needs tls.existingSecret: a Secret with ca.pem and <name>.pem/<name>.key per component (`ddiloco certs` writes them)" -}}
{{- end -}}
{{ .prefix }}TLS_CA: {{ printf "%s/ca.pem" $tls.mountPath | quote }}
{{- with .identity }}
{{ $.prefix }}TLS_CERT: {{ printf "%s/%s.pem" $tls.mountPath . | quote }}
{{ $.prefix }}TLS_KEY: {{ printf "%s/%s.key" $tls.mountPath . | quote }}
{{- end }}
{{- with .serverName }}
{{ $.prefix }}TLS_SERVER_NAME: {{ . | quote }}
{{- end }}
{{- with .healthPort }}
{{ $.prefix }}HEALTH_BIND: {{ printf "0.0.0.0:%d" (int .) | quote }}
{{- end }}
{{- else -}}
{{ .prefix }}INSECURE: "true"
{{- end }}
{{- end }}

{{/*
The TLS Secret volume of a pod, when tls.enabled: (dict "ctx" $ "names" (list "syncer")) projects
ca.pem and <name>.pem/.key of each name only, from tls.existingSecret or "secretName". Never the
whole Secret: it also holds the other components' keys, and a pod that can read them can act as
them (a learner's key uploads as that learner, the syncer's serves as the syncer). A key missing
from the Secret keeps the pod from starting (the kubelet reports the missing key), instead of
running with the wrong identity.
*/}}
{{- define "ddiloco.tlsVolume" -}}
{{- $tls := .ctx.Values.tls }}
{{- if $tls.enabled -}}
- name: tls
  secret:
    secretName: {{ default $tls.existingSecret .secretName }}
    items:
      - key: ca.pem
        path: ca.pem
      {{- range .names }}
      - key: {{ . }}.pem
        path: {{ . }}.pem
      - key: {{ . }}.key
        path: {{ . }}.key
      {{- end }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "ddiloco.tlsVolumeMount" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
The certificate deny list (tls.denyList / tls.denyListConfigMap), only with tls.enabled: the
ConfigMap's name, the env line of a server (prefix DDILOCO_SYNCER_ or DDILOCO_CHECKPOINT_), its
volume and mount. A directory mount, not subPath: the kubelet swaps the file on an update and the
servers re-read it (ddiloco.rpc.security), so revoking needs no restart. The pods carry no hash
of it for the same reason.
*/}}
{{- define "ddiloco.denyListName" -}}
{{- default (printf "%s-tls-deny-list" (include "ddiloco.fullname" .)) .Values.tls.denyListConfigMap -}}
{{- end }}

{{- define "ddiloco.denyListEnv" -}}
{{- if .ctx.Values.tls.enabled }}
{{ .prefix }}TLS_DENY_LIST: {{ printf "%s/deny.txt" .ctx.Values.tls.denyListMountPath | quote }}
{{- end }}
{{- end }}

{{- define "ddiloco.denyListVolume" -}}
{{- if .Values.tls.enabled -}}
- name: tls-deny-list
  configMap:
    name: {{ include "ddiloco.denyListName" . }}
{{- end }}
{{- end }}

{{- define "ddiloco.denyListVolumeMount" -}}
{{- if .Values.tls.enabled -}}
- name: tls-deny-list
  mountPath: {{ .Values.tls.denyListMountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
Client TLS towards etcd (syncer.etcdTLS; docs/deploy.md#etcd-client-tls): the syncer's
DDILOCO_SYNCER_COORD_TLS_* lines, its volume (only the Secret's three keys) and mount. Only the
syncer pods get them: nothing else talks to etcd. https:// endpoints without a Secret, or a Secret
without endpoints, fail the render instead of a syncer that cannot reach etcd.
*/}}
{{- define "ddiloco.etcdTLSEnv" -}}
{{- $etcd := .Values.syncer.etcdTLS }}
{{- $endpoints := toString (default "" .Values.syncer.settings.coordEtcd) }}
{{- if $etcd.existingSecret }}
{{- if eq $endpoints "" }}
{{- fail "syncer.etcdTLS.existingSecret is TLS towards etcd: it needs syncer.settings.coordEtcd (docs/deploy.md#etcd-client-tls)" }}
{{- end }}
DDILOCO_SYNCER_COORD_TLS_CA: {{ printf "%s/ca.crt" $etcd.mountPath | quote }}
DDILOCO_SYNCER_COORD_TLS_CERT: {{ printf "%s/tls.crt" $etcd.mountPath | quote }}
DDILOCO_SYNCER_COORD_TLS_KEY: {{ printf "%s/tls.key" $etcd.mountPath | quote }}
{{- with $etcd.serverName }}
DDILOCO_SYNCER_COORD_TLS_SERVER_NAME: {{ . | quote }}
{{- end }}
{{- else if contains "https://" $endpoints }}
{{- fail "syncer.settings.coordEtcd has https:// endpoints: set syncer.etcdTLS.existingSecret to a Secret with etcd's CA and the etcd client certificate (docs/deploy.md#etcd-client-tls)" }}
{{- else if $etcd.serverName }}
{{- fail "syncer.etcdTLS.serverName needs syncer.etcdTLS.existingSecret" }}
{{- end }}
{{- end }}

{{- define "ddiloco.etcdTLSVolume" -}}
{{- with .Values.syncer.etcdTLS.existingSecret -}}
- name: etcd-tls
  secret:
    secretName: {{ . }}
    items:
      - key: ca.crt
        path: ca.crt
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "ddiloco.etcdTLSVolumeMount" -}}
{{- if .Values.syncer.etcdTLS.existingSecret -}}
- name: etcd-tls
  mountPath: {{ .Values.syncer.etcdTLS.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The port a server's probes use: its health port under TLS, else its gRPC port. */}}
{{- define "ddiloco.probePort" -}}
{{- if .ctx.Values.tls.enabled }}{{ get .ctx.Values.tls.healthPorts .component }}{{ else }}{{ .port }}{{ end }}
{{- end }}

{{/* Data of each component's ConfigMap (also hashed into its pods' checksum/config). */}}
{{- define "ddiloco.store.configData" -}}
{{ include "ddiloco.transport" (dict "ctx" . "prefix" "DDILOCO_CHECKPOINT_" "identity" "checkpoint" "healthPort" .Values.tls.healthPorts.store) }}
{{- include "ddiloco.denyListEnv" (dict "ctx" . "prefix" "DDILOCO_CHECKPOINT_") }}
DDILOCO_CHECKPOINT_LOG_LEVEL: {{ .Values.run.logLevel | quote }}
DDILOCO_CHECKPOINT_JSON_LOGS: {{ .Values.run.jsonLogs | quote }}
{{- include "ddiloco.settingsData" (dict "prefix" "DDILOCO_CHECKPOINT_" "settings" .Values.store.settings) }}
{{- end }}

{{- define "ddiloco.syncer.configData" -}}
{{ include "ddiloco.transport" (dict "ctx" . "prefix" "DDILOCO_SYNCER_" "identity" "syncer" "healthPort" .Values.tls.healthPorts.syncer) }}
{{- include "ddiloco.denyListEnv" (dict "ctx" . "prefix" "DDILOCO_SYNCER_") }}
{{- if and .Values.tls.enabled .Values.tls.storeServerName }}
DDILOCO_SYNCER_CHECKPOINT_TLS_SERVER_NAME: {{ .Values.tls.storeServerName | quote }}
{{- end }}
{{- include "ddiloco.etcdTLSEnv" . }}
DDILOCO_SYNCER_LOG_LEVEL: {{ .Values.run.logLevel | quote }}
DDILOCO_SYNCER_JSON_LOGS: {{ .Values.run.jsonLogs | quote }}
{{- include "ddiloco.settingsData" (dict "prefix" "DDILOCO_SYNCER_" "settings" .Values.syncer.settings) }}
{{- end }}

{{- define "ddiloco.learner.configData" -}}
{{ include "ddiloco.transport" (dict "ctx" . "prefix" "DDILOCO_LEARNER_" "serverName" .Values.tls.syncerServerName) }}
DDILOCO_LEARNER_LOG_LEVEL: {{ .Values.run.logLevel | quote }}
DDILOCO_LEARNER_JSON_LOGS: {{ .Values.run.jsonLogs | quote }}
DDILOCO_LEARNER_NUM_SHARDS: {{ include "ddiloco.envValue" .Values.data.numShards | quote }}
DDILOCO_LEARNER_HELDOUT_FRACTION: {{ include "ddiloco.envValue" .Values.data.heldoutFraction | quote }}
DDILOCO_LEARNER_DATA_DIR: {{ .Values.data.dataDir | quote }}
DDILOCO_LEARNER_MAX_CORPUS_BYTES: {{ include "ddiloco.envValue" .Values.data.maxCorpusBytes | quote }}
{{- include "ddiloco.settingsData" (dict "prefix" "DDILOCO_LEARNER_" "settings" .Values.learners.settings) }}
{{- end }}

{{- define "ddiloco.evaluator.configData" -}}
{{ include "ddiloco.transport" (dict "ctx" . "prefix" "DDILOCO_EVAL_" "identity" "evaluator" "serverName" .Values.tls.syncerServerName) }}
DDILOCO_EVAL_LOG_LEVEL: {{ .Values.run.logLevel | quote }}
DDILOCO_EVAL_JSON_LOGS: {{ .Values.run.jsonLogs | quote }}
DDILOCO_EVAL_NUM_SHARDS: {{ include "ddiloco.envValue" .Values.data.numShards | quote }}
DDILOCO_EVAL_HELDOUT_FRACTION: {{ include "ddiloco.envValue" .Values.data.heldoutFraction | quote }}
DDILOCO_EVAL_DATA_DIR: {{ .Values.data.dataDir | quote }}
DDILOCO_EVAL_MAX_CORPUS_BYTES: {{ include "ddiloco.envValue" .Values.data.maxCorpusBytes | quote }}
{{- include "ddiloco.settingsData" (dict "prefix" "DDILOCO_EVAL_" "settings" .Values.evaluator.settings) }}
{{- end }}

{{/*
Syncer's termination grace: explicit, or graceS + 2 * checkpointTimeoutS + 15 (a checkpoint
already running is drained, the final one written, then the server stopped).
*/}}
{{- define "ddiloco.syncer.terminationGrace" -}}
{{- $s := .Values.syncer.settings }}
{{- $need := add (int (ceil (default 5 $s.graceS))) (mul 2 (int (ceil (default 30 $s.checkpointTimeoutS)))) }}
{{- $explicit := int .Values.syncer.terminationGracePeriodSeconds }}
{{- if eq $explicit 0 }}
{{- add $need 15 }}
{{- else if le $explicit (int $need) }}
{{- fail (printf "syncer.terminationGracePeriodSeconds=%d is too short: the syncer needs graceS + 2 * checkpointTimeoutS = %d s to write its final checkpoint; use 0 (computed) or more" $explicit (int $need)) }}
{{- else }}
{{- $explicit }}
{{- end }}
{{- end }}

{{/*
Pod-level parts shared by every workload: (dict "ctx" $ "component" .Values.syncer).
*/}}
{{- define "ddiloco.podCommon" -}}
{{- $ := .ctx -}}
serviceAccountName: {{ include "ddiloco.serviceAccountName" $ }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with $.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $.Values.podSecurityContext | nindent 2 }}
{{- with .component.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .component.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $nodeFailure := include "ddiloco.nodeFailureTolerations" $ }}
{{- if or .component.tolerations $nodeFailure }}
tolerations:
  {{- with .component.tolerations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- with $nodeFailure }}
  {{- . | nindent 2 }}
  {{- end }}
{{- end }}
{{- with .component.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
NoExecute tolerations of every pod for the node-failure taints, with nodeFailureTolerationSeconds
(a null value leaves the taint to Kubernetes' default, 300 s). See values.yaml for why.
*/}}
{{- define "ddiloco.nodeFailureTolerations" -}}
{{- $seconds := .Values.nodeFailureTolerationSeconds }}
{{- range $key, $taint := dict "notReady" "node.kubernetes.io/not-ready" "unreachable" "node.kubernetes.io/unreachable" }}
{{- /* A null in the user's values deletes the key (Helm), which leaves the default to Kubernetes. */}}
{{- if and (hasKey $seconds $key) (not (kindIs "invalid" (get $seconds $key))) }}
- key: {{ $taint }}
  operator: Exists
  effect: NoExecute
  tolerationSeconds: {{ int (get $seconds $key) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Volumes every pod has: a writable /tmp, and the credentials when configured. */}}
{{- define "ddiloco.commonVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- if or .Values.credentials.create .Values.credentials.existingSecret }}
- name: credentials
  secret:
    secretName: {{ include "ddiloco.credentialsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "ddiloco.commonVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if or .Values.credentials.create .Values.credentials.existingSecret }}
- name: credentials
  mountPath: {{ .Values.credentials.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "ddiloco.credentialsSecretName" -}}
{{- default (printf "%s-credentials" (include "ddiloco.fullname" .)) .Values.credentials.existingSecret }}
{{- end }}

{{/* Environment common to every container. */}}
{{- define "ddiloco.commonEnv" -}}
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
- name: HOME
  value: /tmp
{{- end }}

{{/* NetworkPolicy egress rule to the DNS servers. */}}
{{- define "ddiloco.dnsEgress" -}}
- to:
    {{- toYaml .Values.networkPolicy.dns | nindent 4 }}
  ports:
    - protocol: UDP
      port: 53
    - protocol: TCP
      port: 53
{{- end }}

{{/* The port part of a host:port address, as an integer. */}}
{{- define "ddiloco.addressPort" -}}
{{- $parts := splitList ":" . }}
{{- int (last $parts) }}
{{- end }}

{{/*
Metrics wiring of one component (callers check metrics.enabled):
(dict "ctx" $ "component" "syncer" "prefix" "DDILOCO_SYNCER_").
*/}}
{{- define "ddiloco.metricsEnv" -}}
- name: {{ .prefix }}METRICS_BIND
  value: "0.0.0.0:{{ get .ctx.Values.metrics.ports .component }}"
{{- end }}

{{- define "ddiloco.metricsContainerPort" -}}
- name: metrics
  containerPort: {{ get .ctx.Values.metrics.ports .component }}
  protocol: TCP
{{- end }}

{{- define "ddiloco.metricsAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: "{{ get .ctx.Values.metrics.ports .component }}"
prometheus.io/path: /metrics
{{- end }}

{{/* NetworkPolicy ingress rule admitting the scrapers on a component's metrics port. */}}
{{- define "ddiloco.metricsIngress" -}}
- from:
    {{- toYaml .ctx.Values.metrics.from | nindent 4 }}
  ports:
    - protocol: TCP
      port: {{ get .ctx.Values.metrics.ports .component }}
{{- end }}
