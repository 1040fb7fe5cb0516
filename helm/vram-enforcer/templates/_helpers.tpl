{{- define "vram-enforcer.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vram-enforcer.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "vram-enforcer.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ include "vram-enforcer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "vram-enforcer.selector" -}}
app.kubernetes.io/name: {{ include "vram-enforcer.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "vram-enforcer.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ include "vram-enforcer.text" (dict "name" "image.tag" "value" (.Values.image.tag | default .Chart.AppVersion)) }}
{{- end -}}
{{- end -}}

{{/*
The sidecar mode the webhook injects: sidecarMode, or native for "auto": every Kubernetes
the chart installs on (kubeVersion, from 1.31) runs native sidecars by default. Resolved
here, so that the webhook needs no access to the API at all.
*/}}
{{- define "vram-enforcer.sidecarMode" -}}
{{- if eq .Values.webhook.sidecarMode "auto" -}}
native
{{- else -}}
{{ .Values.webhook.sidecarMode }}
{{- end -}}
{{- end -}}

{{/*
Refuse the values with this message (naming the value, what it takes and the fix): `fail`
for install, upgrade and template. Under `helm lint`, Helm's `fail` only logs and lets the
chart pass (helm/helm#8973, #11957), so a value the install refuses would lint clean: there
the template goes on, and the message is raised as the name of a template that does not
exist, an error lint reports (".. no template "<message>" associated with ..").
*/}}
{{- define "vram-enforcer.refuse" -}}
{{- fail . -}}
{{- include . dict -}}
{{- end -}}

{{/*
A value as text: a number as its digits. dict: name (the value's path), value. A values
file's numbers reach the templates as float64, which print as 1e+06 (--set's are int64); a
whole one is written whole. From 2^53 on, a float64 no longer holds every whole number
(20240101123456789 is read as ...788): such a number is refused, naming the value, rather
than written with other digits than the user gave.
*/}}
{{- define "vram-enforcer.text" -}}
{{- $value := .value -}}
{{- if and (kindIs "float64" $value) (or (ge $value 9007199254740992.0) (le $value -9007199254740992.0)) -}}
{{- include "vram-enforcer.refuse" (printf "%s: this number reads as %.0f, which may not be the digits written: Helm reads a values file's numbers as float64, exact only below 2^53 (9007199254740992). Quote it in the values file (%s: \"...\"), or give it with --set" .name $value (last (splitList "." .name))) -}}
{{- else if and (kindIs "float64" $value) (eq (floor $value) $value) -}}
{{- printf "%.0f" $value -}}
{{- else -}}
{{- toString $value -}}
{{- end -}}
{{- end -}}

{{/*
The text of a value in its form (forms.json: a quantity, a duration, ...), or the values
refused naming the value, the form and an example. dict: root, name (the value's path),
value, form. The forms are checked here, not by values.schema.json (which holds their
types): Helm's schema errors print the whole pattern that failed, a kilobyte of regular
expression, and nothing of what it means. forms.json is made with the schema by
tests/chart/values_schema.py, from the programs' own parsers' bounds.
*/}}
{{- define "vram-enforcer.inForm" -}}
{{- $text := include "vram-enforcer.text" . -}}
{{- $form := index (.root.Files.Get "forms.json" | fromJson) .form -}}
{{- $words := .words | default list -}}
{{- if not (has $text $words) -}}
{{- range $form.patterns -}}
{{- if not (regexMatch . $text) -}}
{{- include "vram-enforcer.refuse" (printf "%s: %s is not %s%s; e.g. %s" $.name (quote $text) (ternary "" (printf "%s, or " (join ", " $words)) (empty $words)) $form.want $form.example) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $text -}}
{{- end -}}

{{/*
A map of label values (a nodeSelector, labels) as YAML, each value as text: Kubernetes
takes only strings there, where `--set agent.nodeSelector.gpu=true` gives a boolean and
`--set ...labels.release=1` a number. dict: name (the map's path), values.
*/}}
{{- define "vram-enforcer.labelValues" -}}
{{- $texts := dict -}}
{{- $name := .name -}}
{{- range $key, $value := .values -}}
{{- $_ := set $texts $key (include "vram-enforcer.text" (dict "name" (printf "%s.%s" $name $key) "value" $value)) -}}
{{- end -}}
{{- toYaml $texts -}}
{{- end -}}

{{/*
vram-enforcer.inForm of the value at path (dotted, under .Values). dict: root, path, form,
and words it takes besides (optional).
*/}}
{{- define "vram-enforcer.formed" -}}
{{- $value := .root.Values -}}
{{- range splitList "." .path -}}
{{- $value = index $value . -}}
{{- end -}}
{{- include "vram-enforcer.inForm" (dict "root" .root "name" .path "value" $value "form" .form "words" .words) -}}
{{- end -}}

{{/*
webhook.tenants.namespaces as the webhook's --namespace-bounds JSON: each namespace's
maxGracePeriod and maxCeiling in their forms, as text.
*/}}
{{- define "vram-enforcer.namespaceBounds" -}}
{{- $bounds := dict -}}
{{- range $namespace, $given := .Values.webhook.tenants.namespaces -}}
{{- $made := deepCopy $given -}}
{{- range $key, $form := dict "maxGracePeriod" "duration" "maxCeiling" "bytes" "defaultVram" "bytes" -}}
{{- if hasKey $given $key -}}
{{- $name := printf "webhook.tenants.namespaces.%s.%s" $namespace $key -}}
{{- $_ := set $made $key (include "vram-enforcer.inForm" (dict "root" $ "name" $name "value" (index $given $key) "form" $form)) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $bounds $namespace $made -}}
{{- end -}}
{{- toJson $bounds -}}
{{- end -}}

{{/*
The bytes of a quantity in the form "bytes" (forms.json: at most 18 digits, no more decimals
than its suffix makes whole, a binary suffix's in eighths), as exact int64 arithmetic: the
chart checks what the webhook checks of a size (zero, a multiple of resource.unit) on the
number, not on its spelling (0Mi is 0; 1500Mi is no whole number of 1Gi).
*/}}
{{- define "vram-enforcer.bytes" -}}
{{- $m := regexReplaceAll "^\\+?([0-9]*)(?:\\.([0-9]*))?(?:[eE]\\+?([0-9]+)|(k|[KMGTPE]i|[MGTPE]))?$" . "${1} ${2}. ${3}. ${4}." | splitList " " -}}
{{- $whole := index $m 0 | atoi -}}
{{- $fraction := index $m 1 | trimSuffix "." -}}
{{- range until 18 }}{{ $fraction = trimSuffix "0" $fraction }}{{ end -}}
{{- $exponent := index $m 2 | trimSuffix "." -}}
{{- $suffix := index $m 3 | trimSuffix "." -}}
{{- if $exponent -}}
{{- $whole = mul $whole (include "vram-enforcer.power" (dict "base" 10 "exponent" (atoi $exponent)) | atoi) -}}
{{- else if hasSuffix "i" $suffix -}}
{{- $scale := include "vram-enforcer.power" (dict "base" 1024 "exponent" (add 1 (index (dict "K" 0 "M" 1 "G" 2 "T" 3 "P" 4 "E" 5) (trimSuffix "i" $suffix)))) | atoi -}}
{{- $eighths := div (printf "%s000" $fraction | trunc 3 | atoi) 125 -}}
{{- $whole = add (mul $whole $scale) (mul $eighths (div $scale 8)) -}}
{{- else if $suffix -}}
{{- $scale := include "vram-enforcer.power" (dict "base" 10 "exponent" (index (dict "k" 3 "M" 6 "G" 9 "T" 12 "P" 15 "E" 18) $suffix)) | atoi -}}
{{- $whole = add (mul $whole $scale) (mul (atoi $fraction) (div $scale (include "vram-enforcer.power" (dict "base" 10 "exponent" (len $fraction)) | atoi))) -}}
{{- end -}}
{{- $whole -}}
{{- end -}}

{{/* base ** exponent, an int64. */}}
{{- define "vram-enforcer.power" -}}
{{- $result := 1 -}}
{{- range until (int .exponent) }}{{ $result = mul $result $.base }}{{ end -}}
{{- $result -}}
{{- end -}}

{{/* Bytes as the shortest exact binary quantity (format_quantity in enforcer/core/parsing.py). */}}
{{- define "vram-enforcer.quantity" -}}
{{- $bytes := int64 . -}}
{{- $text := toString $bytes -}}
{{- range $suffix := list "Ki" "Mi" "Gi" "Ti" "Pi" "Ei" -}}
{{- if and $bytes (eq (mod $bytes 1024) 0) -}}
{{- $bytes = div $bytes 1024 -}}
{{- $text = printf "%d%s" $bytes $suffix -}}
{{- end -}}
{{- end -}}
{{- $text -}}
{{- end -}}

{{/*
The combinations of values the webhook refuses to start with (webhook_settings in
enforcer/core/settings/webhook.py), or could not serve with (one port for both servers; a
metrics port its Service has already), refused here by name: a webhook that crash-loops
with failurePolicy Fail blocks every pod of the opted-in namespaces. Each value alone is
the schema's and the forms'. Included at the top of webhook-deployment.yaml.
*/}}
{{- define "vram-enforcer.webhookChecks" -}}
{{- $webhook := .Values.webhook -}}
{{- if and $webhook.runtimeClassName (ne $webhook.gpuExposure "env") -}}
{{- include "vram-enforcer.refuse" (printf "webhook.runtimeClassName (%s) needs webhook.gpuExposure: env: the webhook sets a runtimeClassName only on the pods it gives the node's GPUs to. Set gpuExposure: env, or leave runtimeClassName empty" $webhook.runtimeClassName) -}}
{{- end -}}
{{- if and $webhook.draDeviceClass (eq $webhook.gpuExposure "env") -}}
{{- include "vram-enforcer.refuse" (printf "webhook.gpuExposure: env cannot be combined with webhook.draDeviceClass (%s): in DRA mode the DRA driver gives each container the GPU it was allocated. Set gpuExposure: none, or leave draDeviceClass empty" $webhook.draDeviceClass) -}}
{{- end -}}
{{- if eq (int $webhook.port) (int $webhook.metricsPort) -}}
{{- include "vram-enforcer.refuse" (printf "webhook.port and webhook.metricsPort are both %d: the webhook serves reviews and metrics on two ports, and would not start. Set different ones (the defaults: 8443, 9479)" (int $webhook.port)) -}}
{{- end -}}
{{- if eq (int $webhook.metricsPort) 443 -}}
{{- include "vram-enforcer.refuse" "webhook.metricsPort is 443, the port of the webhook Service's https (the API server calls it there), which a Service cannot have twice. Set another (the default: 9479)" -}}
{{- end -}}
{{- if and $webhook.draDeviceClass $webhook.kaiAnnotations -}}
{{- include "vram-enforcer.refuse" (printf "webhook.kaiAnnotations: true cannot be combined with webhook.draDeviceClass (%s): a KAI share is counted per node, not allocated on one GPU by a claim. Set kaiAnnotations: false, or leave draDeviceClass empty" $webhook.draDeviceClass) -}}
{{- end -}}
{{- $unit := include "vram-enforcer.bytes" (include "vram-enforcer.formed" (dict "root" . "path" "resource.unit" "form" "bytesFrom1")) | atoi -}}
{{- range $namespace, $given := merge (dict "" (dict)) $webhook.tenants.namespaces -}}
{{- $mode := dict "name" "webhook.undeclaredGpu" "value" $webhook.undeclaredGpu -}}
{{- $vram := dict "name" "webhook.defaultVram" "value" $webhook.defaultVram -}}
{{- if and $namespace (hasKey $given "undeclaredGpu") -}}
{{- $mode = dict "name" (printf "webhook.tenants.namespaces.%s.undeclaredGpu" $namespace) "value" $given.undeclaredGpu -}}
{{- end -}}
{{- if and $namespace (hasKey $given "defaultVram") -}}
{{- $vram = dict "name" (printf "webhook.tenants.namespaces.%s.defaultVram" $namespace) "value" $given.defaultVram -}}
{{- end -}}
{{- $text := include "vram-enforcer.inForm" (dict "root" $ "name" $vram.name "value" $vram.value "form" "bytes") -}}
{{- $bytes := include "vram-enforcer.bytes" $text | atoi -}}
{{- if and (eq $mode.value "default") (eq $bytes 0) -}}
{{- include "vram-enforcer.refuse" (printf "%s is default, which declares a default VRAM on each container that asks for a GPU and declares none, and %s is %s: none to declare. Set %s to a size, e.g. 8Gi, or %s to deny or observe" $mode.name $vram.name (quote $text) $vram.name $mode.name) -}}
{{- end -}}
{{- if mod $bytes $unit -}}
{{- include "vram-enforcer.refuse" (printf "%s (%s) is not a whole number of resource.unit (%d bytes): it is declared on the pods in that unit. Give a multiple of it, e.g. %s" $vram.name (quote $text) $unit (include "vram-enforcer.quantity" (mul (add (div $bytes $unit) 1) $unit))) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The webhook's PodDisruptionBudget's minAvailable (a count, or a percentage of the replicas
rounded up, as the disruption controller counts it), or the values refused where it keeps
every replica: a budget that can never allow a disruption blocks every drain of the nodes
the webhook runs on. Rendered only with two replicas or more (webhook-deployment.yaml).
*/}}
{{- define "vram-enforcer.webhookMinAvailable" -}}
{{- $replicas := int .Values.webhook.replicas -}}
{{- $text := include "vram-enforcer.text" (dict "name" "webhook.podDisruptionBudget.minAvailable" "value" .Values.webhook.podDisruptionBudget.minAvailable) -}}
{{- $kept := 0 -}}
{{- if hasSuffix "%" $text -}}
{{- $kept = div (add (mul (trimSuffix "%" $text | int) $replicas) 99) 100 -}}
{{- else -}}
{{- $kept = int $text -}}
{{- end -}}
{{- if ge $kept $replicas -}}
{{- include "vram-enforcer.refuse" (printf "webhook.podDisruptionBudget.minAvailable (%s) keeps %d of the webhook's %d replicas (webhook.replicas) available: no node they run on could ever be drained. Set minAvailable below webhook.replicas (e.g. %d), or raise webhook.replicas" $text $kept $replicas (sub $replicas 1)) -}}
{{- end -}}
{{- if hasSuffix "%" $text }}{{ quote $text }}{{ else }}{{ $kept }}{{ end -}}
{{- end -}}

{{/*
The webhook's and the agent's names, which their Services bear: a DNS label of at most 63
characters, which a fullname of 63 with -webhook was not (a release name of 50 characters
installed nowhere, and linted clean).
*/}}
{{- define "vram-enforcer.webhookName" -}}
{{ include "vram-enforcer.fullname" . | trunc 55 | trimSuffix "-" }}-webhook
{{- end -}}

{{- define "vram-enforcer.agentName" -}}
{{ include "vram-enforcer.fullname" . | trunc 57 | trimSuffix "-" }}-agent
{{- end -}}

{{- define "vram-enforcer.tlsSecret" -}}
{{ include "vram-enforcer.webhookName" . }}-tls
{{- end -}}

{{/* The DNS names the API server uses for the webhook's Service. */}}
{{- define "vram-enforcer.webhookDNS" -}}
{{- $svc := include "vram-enforcer.webhookName" . -}}
{{- list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) | toJson -}}
{{- end -}}

{{/*
The self-signed TLS material, base64-encoded, as JSON {"crt", "key", "ca"}: the existing
Secret's when there is one (lookup), so that upgrades keep the certificate and the
caBundle the API server trusts; else a new CA and certificate. Generated once per render
and memoized, so the Secret, the caBundle and the Deployment's checksum agree.
*/}}
{{- define "vram-enforcer.tlsData" -}}
{{- $tls := .Values.webhook.tls -}}
{{- if not (hasKey $tls "generated") -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "vram-enforcer.tlsSecret" .) -}}
{{- if and $existing (hasKey ($existing.data | default dict) "ca.crt") -}}
{{- $_ := set $tls "generated" (dict "crt" (index $existing.data "tls.crt") "key" (index $existing.data "tls.key") "ca" (index $existing.data "ca.crt")) -}}
{{- else -}}
{{- $caPair := genCA (printf "%s-ca" (include "vram-enforcer.webhookName" .)) 3650 -}}
{{- $dns := include "vram-enforcer.webhookDNS" . | fromJsonArray -}}
{{- $cert := genSignedCert (index $dns 2) nil $dns 3650 $caPair -}}
{{- $_ := set $tls "generated" (dict "crt" ($cert.Cert | b64enc) "key" ($cert.Key | b64enc) "ca" ($caPair.Cert | b64enc)) -}}
{{- end -}}
{{- end -}}
{{- toJson (get $tls "generated") -}}
{{- end -}}
