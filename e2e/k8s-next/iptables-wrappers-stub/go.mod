// A stand-in for sigs.k8s.io/iptables-wrappers v1.0.0, whose zip the Go module proxy refuses
// ("This module version is not available"): see ../build.sh. Only the API kube-proxy v1.38
// compiles against; every constructor reports iptables as unavailable.
module sigs.k8s.io/iptables-wrappers

go 1.26

require k8s.io/utils v0.0.0-20260626114624-be93311217bd
