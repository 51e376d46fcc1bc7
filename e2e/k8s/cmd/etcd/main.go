// Command etcd runs an embedded etcd server for the tests' control plane: one member, data in
// --data-dir, clients on --listen-client-urls. It exits cleanly on SIGTERM or SIGINT.
//
// `etcd compact --endpoint URL` compacts the history of a running server up to its current
// revision (what an operator's `etcdctl compact` does): watches that resume from an older
// revision then get "410 Gone" from the API server, as after a long disconnection.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "compact" {
		compact(os.Args[2:])
		return
	}
	serve()
}

func compact(args []string) {
	flags := flag.NewFlagSet("compact", flag.ExitOnError)
	endpoint := flags.String("endpoint", "http://127.0.0.1:2379", "the server's client URL")
	_ = flags.Parse(args)
	client, err := clientv3.New(clientv3.Config{Endpoints: []string{*endpoint}, DialTimeout: 10 * time.Second})
	if err != nil {
		log.Fatalf("connect %s: %v", *endpoint, err)
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Any read returns the store's current revision in its header.
	status, err := client.Get(ctx, "compact-probe")
	if err != nil {
		log.Fatalf("read revision: %v", err)
	}
	revision := status.Header.Revision
	if _, err := client.Compact(ctx, revision, clientv3.WithCompactPhysical()); err != nil {
		log.Fatalf("compact to %d: %v", revision, err)
	}
	fmt.Println(revision)
}

func serve() {
	dataDir := flag.String("data-dir", "", "directory for etcd's data (required)")
	clientURL := flag.String("listen-client-urls", "http://127.0.0.1:2379", "the client URL")
	peerURL := flag.String("listen-peer-urls", "http://127.0.0.1:2380", "the peer URL")
	quota := flag.Int64("quota-backend-bytes", 2<<30, "backend size limit in bytes")
	flag.Parse()
	if *dataDir == "" {
		log.Fatal("--data-dir is required")
	}

	cfg := embed.NewConfig()
	cfg.Dir = *dataDir
	cfg.LogLevel = "warn"
	cfg.QuotaBackendBytes = *quota
	client, err := url.Parse(*clientURL)
	if err != nil {
		log.Fatalf("--listen-client-urls: %v", err)
	}
	peer, err := url.Parse(*peerURL)
	if err != nil {
		log.Fatalf("--listen-peer-urls: %v", err)
	}
	cfg.ListenClientUrls = []url.URL{*client}
	cfg.AdvertiseClientUrls = []url.URL{*client}
	cfg.ListenPeerUrls = []url.URL{*peer}
	cfg.AdvertisePeerUrls = []url.URL{*peer}
	cfg.InitialCluster = cfg.Name + "=" + peer.String()

	server, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("start etcd: %v", err)
	}
	defer server.Close()
	select {
	case <-server.Server.ReadyNotify():
		log.Printf("etcd ready on %s", client)
	case <-time.After(60 * time.Second):
		server.Server.Stop()
		log.Fatal("etcd did not become ready within 60 s")
	}

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	select {
	case err := <-server.Err():
		log.Fatalf("etcd: %v", err)
	case <-signals:
	}
}
