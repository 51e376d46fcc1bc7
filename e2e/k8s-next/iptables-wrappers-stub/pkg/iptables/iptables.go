// Package iptables stands in for sigs.k8s.io/iptables-wrappers/pkg/iptables in the kube-proxy
// pyproxy's tests build from k8s.io/kubernetes v1.38.0-beta.0 (e2e/k8s-next): the module proxy
// does not serve the real v1.38 dependency. It has the API kube-proxy compiles against and no
// implementation: New fails and NewBestEffort finds no iptables, so the iptables and ipvs modes
// refuse to start, and nftables mode's start-up sweep of iptables leftovers does nothing (the
// tests' node namespaces have none). The nftables proxier does not use this package.
package iptables

import (
	"bytes"
	"context"
	"errors"
	"time"

	"k8s.io/utils/set"
)

// Protocol is the IP family of an Interface.
type Protocol string

// Table is an iptables table.
type Table string

// Chain is an iptables chain.
type Chain string

// RulePosition is where EnsureRule puts a rule.
type RulePosition string

// Mode selects the iptables backend.
type Mode string

const (
	ProtocolIPv4 Protocol = "IPv4"
	ProtocolIPv6 Protocol = "IPv6"

	TableNAT    Table = "nat"
	TableFilter Table = "filter"
	TableMangle Table = "mangle"

	ChainPostrouting Chain = "POSTROUTING"
	ChainPrerouting  Chain = "PREROUTING"
	ChainOutput      Chain = "OUTPUT"
	ChainInput       Chain = "INPUT"
	ChainForward     Chain = "FORWARD"

	Prepend RulePosition = "-I"
	Append  RulePosition = "-A"

	DetectHostMode Mode = "detect"
)

// ErrNotBuilt is what every operation reports.
var ErrNotBuilt = errors.New("iptables support is not built into this kube-proxy (pyproxy e2e/k8s-next stub)")

// Interface is the iptables runner the iptables and ipvs proxiers use.
type Interface interface {
	Protocol() Protocol
	IsIPv6() bool
	EnsureChain(ctx context.Context, table Table, chain Chain) (bool, error)
	FlushChain(ctx context.Context, table Table, chain Chain) error
	DeleteChain(ctx context.Context, table Table, chain Chain) error
	EnsureRule(ctx context.Context, position RulePosition, table Table, chain Chain, args ...string) (bool, error)
	DeleteRule(ctx context.Context, table Table, chain Chain, args ...string) error
	SaveInto(ctx context.Context, table Table, buffer *bytes.Buffer) error
	Restore(ctx context.Context, data []byte) error
	Monitor(ctx context.Context, canary Chain, tables []Table, reloadFunc func(), interval time.Duration)
}

// ParseError is an iptables-restore error that names a line.
type ParseError interface {
	error
	Line() int
}

// LineData is one line of iptables-restore input.
type LineData struct {
	Line int
	Data string
}

// New always fails: there is no iptables here.
func New(ctx context.Context, protocol Protocol, mode Mode) (Interface, error) {
	return nil, ErrNotBuilt
}

// NewBestEffort finds no usable family.
func NewBestEffort(ctx context.Context, mode Mode) map[Protocol]Interface {
	return map[Protocol]Interface{}
}

// IsNotFoundError reports whether err means a missing rule or chain.
func IsNotFoundError(err error) bool {
	return false
}

// ExtractLines returns nothing (there is never a restore to report on).
func ExtractLines(lines []byte, line, count int) []LineData {
	return nil
}

// MakeChainLine is the iptables-restore line declaring chain.
func MakeChainLine(chain Chain) string {
	return ":" + string(chain) + " - [0:0]"
}

// GetChainsFromTable returns no chains.
func GetChainsFromTable(save []byte) set.Set[Chain] {
	return set.New[Chain]()
}
