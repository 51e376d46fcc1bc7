{{/*
The labels of every object, as manifests/ has them; helm.sh/chart and managed-by are the
chart's own (on the objects only, never in a selector or the pod template).
*/}}
{{- define "pyproxy.labels" -}}
app.kubernetes.io/name: pyproxy
app.kubernetes.io/component: service-proxy
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
The API server's address, refused when it is one a node reaches only through a service
proxy's rules: the bootstrap trap (docs/deploying.md, step 2). pyproxy checks the same at run
time (pyproxy/cluster/apiconnection.py, service_address_problem); the chart refuses it
before any pod starts. The `kubernetes` Service's ClusterIPs are looked up on the cluster by
helm install and upgrade (helm template and lint see no cluster).
*/}}
{{- define "pyproxy.apiServerHost" -}}
{{- $host := toString .Values.apiServer.host | trim -}}
{{- $see := "set apiServer.host to the API server's real address, as kube-proxy's kubeconfig names it (kubeadm: controlPlaneEndpoint), or a load balancer in front of the API servers: docs/deploying.md, step 2" -}}
{{- if not $host -}}
{{- fail (printf "apiServer.host is required: pyproxy must reach the API server without a Service address, which works only once a proxy has programmed it (a node that reboots would never come up); %s" $see) -}}
{{- end -}}
{{- $name := lower (trimSuffix "." $host) -}}
{{- if or (has $name (list "kubernetes" "kubernetes.default")) (hasSuffix ".svc" $name) (hasSuffix ".svc.cluster.local" $name) -}}
{{- fail (printf "apiServer.host %s is a cluster DNS name: resolving it needs CoreDNS's ClusterIP and reaching it the kubernetes Service's, both programmed by the proxy itself (the bootstrap trap); %s" $host $see) -}}
{{- end -}}
{{- $service := lookup "v1" "Service" "default" "kubernetes" -}}
{{- if $service -}}
{{- if has $host ($service.spec.clusterIPs | default (list $service.spec.clusterIP)) -}}
{{- fail (printf "apiServer.host %s is the ClusterIP of the kubernetes Service: it works only while some proxy's rules for it are in the kernel (the bootstrap trap); %s" $host $see) -}}
{{- end -}}
{{- end -}}
{{- $host -}}
{{- end }}

{{/*
"true" when pyproxy is to read kubeadm's kube-proxy ConfigMap (the values' `kubeadm`), which is
in kube-system: a pod mounts ConfigMaps of its own namespace only. Empty otherwise.
*/}}
{{- define "pyproxy.kubeadm" -}}
{{- if .Values.kubeadm -}}
{{- if ne .Release.Namespace "kube-system" -}}
{{- fail (printf "kubeadm=true reads kubeadm's ConfigMap kube-system/kube-proxy, which a pod can mount only in its own namespace: install the release in kube-system, not %s" .Release.Namespace) -}}
{{- end -}}
true
{{- end -}}
{{- end }}

{{/* The port of a host:port bind address (config.healthzBindAddress, metricsBindAddress). */}}
{{- define "pyproxy.port" -}}
{{- $port := regexFind "[0-9]+$" (toString .address) -}}
{{- if not $port -}}
{{- fail (printf "config.%s: %q has no port" .field .address) -}}
{{- end -}}
{{- $port -}}
{{- end }}

{{- define "pyproxy.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}
{{- end }}
