{{/*
The chart name, or nameOverride.
*/}}
{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name of the release's resources. It starts with the release name, so two releases
in one namespace never collide.
*/}}
{{- define "pagedserve.fullname" -}}
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

{{- define "pagedserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels. app.kubernetes.io/instance is the release name, which keeps the selectors
of two releases in one namespace disjoint. They are immutable on a Deployment: never add
a label here that can change between upgrades.
*/}}
{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pagedserve.labels" -}}
helm.sh/chart: {{ include "pagedserve.chart" . }}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: inference-server
{{- end }}

{{- define "pagedserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagedserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image reference. The Dockerfile's targets are tagged <version>-cpu and <version>-gpu.
*/}}
{{- define "pagedserve.image" -}}
{{- $variant := ternary "gpu" "cpu" (gt (int .Values.gpu.count) 0) }}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion $variant) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/*
The Secret holding the API key, or "" when the API is open.
*/}}
{{- define "pagedserve.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.value }}
{{- printf "%s-api-key" (include "pagedserve.fullname" .) }}
{{- end }}
{{- end }}

{{- define "pagedserve.modelClaimName" -}}
{{- .Values.model.pvc.existingClaim | default (printf "%s-models" (include "pagedserve.fullname" .)) }}
{{- end }}

{{/*
The model directory as the server sees it, or "" for the image's default model.
*/}}
{{- define "pagedserve.modelPath" -}}
{{- if eq .Values.model.source "image" }}
{{- .Values.model.path }}
{{- else if .Values.model.path }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.path) }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}

{{/*
The server flags as PAGEDSERVE_* variables: maxNumSeqs -> PAGEDSERVE_MAX_NUM_SEQS. Helm
holds every number as a float64, so whole numbers are printed as integers (4294967296, not
4.294967296e+09). A list is comma-separated, as the server reads a repeatable flag from its
variable. null, "" and [] leave the flag to the server's default.
*/}}
{{- define "pagedserve.serverEnv" -}}
{{- range $flag, $value := .Values.server }}
{{- if and (kindIs "float64" $value) (eq $value (float64 (int64 $value))) }}
{{- $value = int64 $value }}
{{- end }}
{{- if kindIs "slice" $value }}
{{- $value = join "," $value }}
{{- end }}
{{- if not (or (kindIs "invalid" $value) (eq (toString $value) "")) }}
- name: PAGEDSERVE_{{ snakecase $flag | upper }}
  value: {{ toString $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
SIGKILL comes terminationGracePeriodSeconds after deletion starts, and that period includes
the preStop hook. Deriving it here keeps it longer than the preStop sleep plus the server's
drain, whatever the values.
*/}}
{{- define "pagedserve.terminationGracePeriodSeconds" -}}
{{- add .Values.shutdown.preStopSleepSeconds .Values.server.shutdownTimeout .Values.shutdown.graceMarginSeconds }}
{{- end }}

{{/*
The user cache directory in the image (HOME is /home/pagedserve in the Dockerfile).
*/}}
{{- define "pagedserve.userCacheDir" -}}
/home/pagedserve/.cache
{{- end }}

{{/*
The responses store's claim: the given one, or the chart's.
*/}}
{{- define "pagedserve.responsesClaimName" -}}
{{- .Values.responses.persistence.existingClaim | default (printf "%s-responses" (include "pagedserve.fullname" .)) }}
{{- end }}

{{/*
Combinations the schema cannot express.
*/}}
{{- define "pagedserve.validate" -}}
{{- if and .Values.autoscaling.enabled .Values.keda.enabled }}
{{- fail "autoscaling.enabled and keda.enabled are mutually exclusive: KEDA manages its own HorizontalPodAutoscaler" }}
{{- end }}
{{- if and .Values.keda.enabled (not .Values.keda.prometheus.serverAddress) }}
{{- fail "keda.enabled needs keda.prometheus.serverAddress" }}
{{- end }}
{{- if and (eq .Values.model.source "hostPath") (not .Values.model.hostPath.path) }}
{{- fail "model.source=hostPath needs model.hostPath.path" }}
{{- end }}
{{- if and (eq .Values.model.source "image") .Values.model.path (not (isAbs .Values.model.path)) }}
{{- fail "model.source=image needs an absolute model.path (or an empty one for the default model)" }}
{{- end }}
{{- if and .Values.inferencePool.httpRoute.enabled (not .Values.inferencePool.enabled) }}
{{- fail "inferencePool.httpRoute.enabled needs inferencePool.enabled: the route's backend is the InferencePool" }}
{{- end }}
{{- if and .Values.responses.persistence.enabled .Values.responses.redis.existingSecret }}
{{- fail "responses.persistence and responses.redis are two stores: enable one" }}
{{- end }}
{{- if and .Values.responses.persistence.enabled (or (gt (int .Values.replicaCount) 1) .Values.autoscaling.enabled .Values.keda.enabled) }}
{{- fail "responses.persistence keeps SQLite on one claim, for one replica: more replicas share responses.redis" }}
{{- end }}
{{- $keys := or .Values.apiKey.value .Values.apiKey.existingSecret .Values.apiKeys.existingSecret }}
{{- $picker := and .Values.inferencePool.enabled .Values.inferencePool.endpointPicker.deploy }}
{{- if and $picker .Values.kvEvents.enabled $keys (not .Values.server.renderAllowFrom) }}
{{- fail "kvEvents with apiKey or apiKeys needs server.renderAllowFrom: the endpoint picker tokenizes every request through the server's render endpoints and sends no API key, so they answer it 401 unless its pods' network is listed there (see docs/kubernetes.md, Tenants and precise routing)" }}
{{- end }}
{{- if and .Values.kvEvents.enabled (eq (int (.Values.kvEvents.replayPort | default 0)) (int .Values.kvEvents.port)) }}
{{- fail "kvEvents.replayPort and kvEvents.port must differ: one is the events' PUB socket, the other the replay ROUTER" }}
{{- end }}
{{- $tp := int (.Values.server.tensorParallelSize | default 1) }}
{{- if and (gt (int .Values.gpu.count) 1) (gt $tp 1) (ne (int .Values.gpu.count) $tp) }}
{{- fail (printf "gpu.count (%d) and server.tensorParallelSize (%d) disagree: each rank takes one GPU; set only tensorParallelSize" (int .Values.gpu.count) $tp) }}
{{- end }}
{{- include "pagedserve.validateLora" . }}
{{- end }}

{{/*
LoRA combinations: adapters need a volume to be read from, a model name of their own, and
a server on one rank.
*/}}
{{- define "pagedserve.validateLora" -}}
{{- $lora := .Values.lora }}
{{- if not $lora.enabled }}
{{- if or $lora.source $lora.adapters }}
{{- fail "lora.source and lora.adapters need lora.enabled" }}
{{- end }}
{{- else }}
{{- if gt (int (.Values.server.tensorParallelSize | default 1)) 1 }}
{{- fail "lora.enabled needs server.tensorParallelSize 1: pagedserve serves LoRA adapters on a single rank" }}
{{- end }}
{{- if and $lora.adapters (not $lora.source) }}
{{- fail "lora.adapters need lora.source (pvc or configMap): the server reads each adapter's directory from a volume the pod mounts" }}
{{- end }}
{{- if and (eq $lora.source "pvc") (not $lora.pvc.existingClaim) }}
{{- fail "lora.source=pvc needs lora.pvc.existingClaim" }}
{{- end }}
{{- if and (eq $lora.source "configMap") (not $lora.adapters) }}
{{- fail "lora.source=configMap needs lora.adapters, each naming its configMap" }}
{{- end }}
{{- if and (ne .Values.model.source "image") (eq (trimSuffix "/" $lora.mountPath) (trimSuffix "/" .Values.model.mountPath)) }}
{{- fail "lora.mountPath and model.mountPath must differ: one directory holds the model, the other the adapters" }}
{{- end }}
{{- $served := include "pagedserve.servedModelName" . }}
{{- $seen := dict }}
{{- range $lora.adapters }}
{{- if hasKey $seen .name }}
{{- fail (printf "lora.adapters: %q is listed twice: each adapter is a model name of its own" .name) }}
{{- end }}
{{- $_ := set $seen .name true }}
{{- if eq .name $served }}
{{- fail (printf "lora.adapters: %q is the served model name: requests for it must reach the base model, so name the adapter otherwise" .name) }}
{{- end }}
{{- if and (eq $lora.source "configMap") (not .configMap) }}
{{- fail (printf "lora.adapters: %q needs a configMap with lora.source=configMap" .name) }}
{{- end }}
{{- if and (eq $lora.source "configMap") .path }}
{{- fail (printf "lora.adapters: %q has a path, which is for lora.source=pvc: a ConfigMap adapter is mounted at lora.mountPath/<name>" .name) }}
{{- end }}
{{- if and (eq $lora.source "pvc") .configMap }}
{{- fail (printf "lora.adapters: %q has a configMap, which is for lora.source=configMap" .name) }}
{{- end }}
{{- end }}
{{- $gpuLoras := int ($lora.maxLoras | default 1) }}
{{- if and $lora.maxCpuLoras (lt (int $lora.maxCpuLoras) $gpuLoras) }}
{{- fail (printf "lora.maxCpuLoras (%d) is below lora.maxLoras (%d): the adapters of a batch are also kept in CPU memory" (int $lora.maxCpuLoras) $gpuLoras) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
vLLM's --lora-modules as the server reads its variable: name=directory, comma-separated. A
pvc adapter's directory is its path (default: its name) under lora.mountPath; a ConfigMap
adapter is mounted at lora.mountPath/<name>.
*/}}
{{- define "pagedserve.loraModules" -}}
{{- $mount := trimSuffix "/" .Values.lora.mountPath }}
{{- $modules := list }}
{{- range .Values.lora.adapters }}
{{- $dir := .name }}
{{- if eq $.Values.lora.source "pvc" }}{{ $dir = .path | default .name | trimSuffix "/" }}{{ end }}
{{- $modules = append $modules (printf "%s=%s/%s" .name $mount $dir) }}
{{- end }}
{{- join "," $modules }}
{{- end }}

{{/*
The server's LoRA flags as PAGEDSERVE_* variables; null counts leave the server's defaults.
*/}}
{{- define "pagedserve.loraEnv" -}}
{{- if .Values.lora.enabled }}
- name: PAGEDSERVE_ENABLE_LORA
  value: "true"
{{- with include "pagedserve.loraModules" . }}
- name: PAGEDSERVE_LORA_MODULES
  value: {{ . | quote }}
{{- end }}
{{- range $flag, $value := pick .Values.lora "maxLoras" "maxLoraRank" "maxCpuLoras" }}
{{- if not (kindIs "invalid" $value) }}
- name: PAGEDSERVE_{{ snakecase $flag | upper }}
  value: {{ int64 $value | toString | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The volume the pvc adapters are mounted from: the model's own when it is the same claim, so
that the pod declares each claim once; else lora-adapters.
*/}}
{{- define "pagedserve.loraVolumeName" -}}
{{- if and (eq .Values.model.source "pvc") (eq .Values.lora.pvc.existingClaim (include "pagedserve.modelClaimName" .)) }}model
{{- else }}lora-adapters{{- end }}
{{- end }}

{{/*
GPUs per pod: one per tensor-parallel rank on a GPU pod (gpu.count > 0), else gpu.count.
*/}}
{{- define "pagedserve.gpuCount" -}}
{{- if gt (int .Values.gpu.count) 0 }}
{{- max (int .Values.gpu.count) (int (.Values.server.tensorParallelSize | default 1)) }}
{{- else }}0{{- end }}
{{- end }}

{{/*
The model name clients send, as the server derives it: servedModelName, else the model
directory's name, else the bundled model's.
*/}}
{{- define "pagedserve.servedModelName" -}}
{{- if .Values.server.servedModelName }}{{ .Values.server.servedModelName }}
{{- else if include "pagedserve.modelPath" . }}{{ base (include "pagedserve.modelPath" .) }}
{{- else }}SmolLM2-135M-Instruct{{- end }}
{{- end }}

{{/*
vLLM's --kv-events-config for this pod: bound on every interface, with llm-d's topic, and
the replay socket a picker that (re)starts rebuilds its index from. $(POD_IP) is expanded
by Kubernetes from the variable defined before it.
*/}}
{{- define "pagedserve.kvEventsConfig" -}}
{{- $config := dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int .Values.kvEvents.port)) "topic" (printf "kv@$(POD_IP)@%s" (include "pagedserve.servedModelName" .)) }}
{{- with .Values.kvEvents.replayPort }}
{{- $_ := set $config "replay_endpoint" (printf "tcp://*:%d" (int .)) }}
{{- end }}
{{- $config | toJson }}
{{- end }}

{{/*
The labels the EPP reads to map a pod's metric names: llm-d's key and GIE's older one.
*/}}
{{- define "pagedserve.engineTypeLabels" -}}
llm-d.ai/engine-type: {{ .Values.inferencePool.engineType }}
inference.networking.k8s.io/engine-type: {{ .Values.inferencePool.engineType }}
{{- end }}

{{/*
The endpoint picker's name, and its labels: its own app.kubernetes.io/name, so that no
selector of the server's (Service, PodDisruptionBudget, ServiceMonitor, InferencePool)
ever picks its pods or its Service.
*/}}
{{- define "pagedserve.eppName" -}}
{{- .Values.inferencePool.endpointPicker.serviceName | default (printf "%s-epp" (include "pagedserve.fullname" .) | trunc 63 | trimSuffix "-") }}
{{- end }}

{{/*
Endpoint picker replicas: endpointPicker.replicas, else 2 with KV events and 1 without.
With KV events every replica subscribes to every pod and keeps the same index, so all of
them serve. Without, each replica's prefix index is its own routing history: several then
elect a leader, which alone serves ("true" from eppLeaderElection).
*/}}
{{- define "pagedserve.eppReplicas" -}}
{{- $replicas := .Values.inferencePool.endpointPicker.replicas }}
{{- if kindIs "invalid" $replicas }}{{ ternary 2 1 .Values.kvEvents.enabled }}
{{- else }}{{ int $replicas }}{{ end }}
{{- end }}

{{- define "pagedserve.eppLeaderElection" -}}
{{- if and (gt (int (include "pagedserve.eppReplicas" .)) 1) (not .Values.kvEvents.enabled) }}true{{ end }}
{{- end }}

{{- define "pagedserve.eppSelectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" . }}-epp
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end }}

{{- define "pagedserve.eppLabels" -}}
helm.sh/chart: {{ include "pagedserve.chart" . }}
{{ include "pagedserve.eppSelectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
The EPP's EndpointPickerConfig (llm-d router). With KV events, prefix hits are precise: the
EPP tokenizes each request through the server's render endpoint and looks its blocks up in
the index the pods' events keep; without, it estimates them from its own routing history.
With LoRA, the lora-affinity-scorer prefers pods where the request's adapter is already
running, then pods with room to load it. It reads vllm:lora_requests_info, which the
core-metrics-extractor's built-in vllm engine config already scrapes (loraSpec), so neither
an engineConfigs entry nor the deprecated --lora-info-metric flag is needed.
*/}}
{{- define "pagedserve.eppConfig" -}}
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: metrics-data-source
  - type: core-metrics-extractor
  - type: single-profile-handler
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: max-score-picker
{{- if .Values.lora.enabled }}
  - type: lora-affinity-scorer
{{- end }}
{{- if .Values.kvEvents.enabled }}
  - type: endpoint-notification-source
  - type: token-producer
    parameters:
      modelName: {{ include "pagedserve.servedModelName" . | quote }}
      vllm:
        url: {{ printf "http://%s.%s.svc:%d" (include "pagedserve.fullname" .) .Release.Namespace (int .Values.service.port) | quote }}
  - type: precise-prefix-cache-producer
    parameters:
      tokenProcessorConfig:
        blockSize: {{ .Values.server.blockSize | default 16 }}
      kvEventsConfig:
        topicFilter: "kv@"
        discoverPods: true
        podDiscoveryConfig:
          socketPort: {{ .Values.kvEvents.port }}
          {{- with .Values.kvEvents.replayPort }}
          replaySocketPort: {{ . }}
          {{- end }}
  - type: prefix-cache-scorer
    parameters:
      prefixMatchInfoProducerName: precise-prefix-cache-producer
{{- else }}
  - type: prefix-cache-scorer
{{- end }}
dataLayer:
  sources:
    - pluginRef: metrics-data-source
      extractors:
        - pluginRef: core-metrics-extractor
{{- if .Values.kvEvents.enabled }}
    - pluginRef: endpoint-notification-source
      extractors:
        - pluginRef: precise-prefix-cache-producer
{{- end }}
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: prefix-cache-scorer
        weight: 2
      - pluginRef: kv-cache-utilization-scorer
        weight: 1
      - pluginRef: queue-scorer
        weight: 1
      {{- if .Values.lora.enabled }}
      - pluginRef: lora-affinity-scorer
        weight: 1
      {{- end }}
      - pluginRef: max-score-picker
{{- end }}
