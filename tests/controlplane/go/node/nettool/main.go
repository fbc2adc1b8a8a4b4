// Command nettool is the tests' network probe, run as a pod on the real node.
//
//	nettool serve PORT          answer every HTTP request with "hello from HOSTNAME"
//	nettool check CHECK...      run each check, print one JSON line per check, exit 0
//
// Checks: get=URL (HTTP GET), resolve=NAME (cluster DNS), apiserver (GET /version from
// the kubernetes Service with the pod's service-account token), dial=HOST:PORT (TCP).
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"
)

const serviceAccount = "/var/run/secrets/kubernetes.io/serviceaccount"

func main() {
	if len(os.Args) >= 3 && os.Args[1] == "serve" {
		serve(os.Args[2])
		return
	}
	if len(os.Args) >= 2 && os.Args[1] == "check" {
		for _, check := range os.Args[2:] {
			report(check)
		}
		return
	}
	fmt.Fprintln(os.Stderr, "usage: nettool serve PORT | nettool check CHECK...")
	os.Exit(2)
}

func serve(port string) {
	host, _ := os.Hostname()
	http.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "hello from %s", host)
	})
	fmt.Println("serving on port", port)
	if err := http.ListenAndServe(":"+port, nil); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// report runs one check and prints {"check": ..., "ok": ..., "result"|"error": ...}.
func report(check string) {
	kind, arg, _ := strings.Cut(check, "=")
	result, err := run(kind, arg)
	line := map[string]any{"check": check, "ok": err == nil, "result": result}
	if err != nil {
		line["error"] = err.Error()
	}
	out, _ := json.Marshal(line)
	fmt.Println(string(out))
}

func run(kind, arg string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	switch kind {
	case "get":
		return get(ctx, http.DefaultClient, arg, "")
	case "resolve":
		addrs, err := net.DefaultResolver.LookupHost(ctx, arg)
		return strings.Join(addrs, ","), err
	case "apiserver":
		return apiserver(ctx)
	case "dial":
		conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", arg)
		if err != nil {
			return "", err
		}
		return "connected", conn.Close()
	}
	return "", fmt.Errorf("unknown check %q", kind)
}

func get(ctx context.Context, client *http.Client, url, token string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("%s: %s", resp.Status, body)
	}
	return string(body), err
}

// apiserver reaches the API server the way in-cluster clients do: the kubernetes
// Service's address from the environment, its CA and the pod's token.
func apiserver(ctx context.Context) (string, error) {
	ca, err := os.ReadFile(serviceAccount + "/ca.crt")
	if err != nil {
		return "", err
	}
	token, err := os.ReadFile(serviceAccount + "/token")
	if err != nil {
		return "", err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}}
	host := net.JoinHostPort(os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT"))
	return get(ctx, client, "https://"+host+"/version", strings.TrimSpace(string(token)))
}
