#!/usr/bin/env bash
# etcd (the coordination engine of syncer leader election, issue 23) for the tests, the same for
# CI and developers: the etcd binary of Debian's etcd-server package (see deb_binary_env.sh; the
# package is never installed, so no etcd service runs on this machine: each test starts its own
# etcd on free ports in a temporary directory and stops it by PID). Prints etcd's path.
exec bash "$(dirname "${BASH_SOURCE[0]}")/deb_binary_env.sh" etcd etcd-server "etcd (3.4 or newer)"
