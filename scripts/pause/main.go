// Command pause is the sandbox ("pause") container of the one-node cluster's pods: it holds the
// pod's namespaces open, reaps the zombies it inherits, and exits on SIGINT or SIGTERM.
// scripts/cluster.sh builds it statically and wraps it in an image, since no registry is reachable.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func reap() {
	for {
		var status syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s == syscall.SIGCHLD {
			reap()
			continue
		}
		os.Exit(0)
	}
}
