#!/bin/sh
# redis-server with the ACL users of deploy/redis/users.acl (compose's redis service runs this). Each #{VAR} in
# that file becomes the SHA-256 of the password in the environment variable VAR, so the rendered file holds no
# password and none is on a command line (`ps` shows redis-server's arguments); the variables are unset before
# redis-server starts. Arguments are redis-server's. REDIS_ACL_FILE: where the rendered file goes (a tmpfs in
# compose); REDIS_SERVER: the server binary.
set -eu
template="$(dirname "$0")/users.acl"
acl="${REDIS_ACL_FILE:-/tmp/users.acl}"
umask 077
: >"$acl"
used=""
while IFS= read -r line || [ -n "$line" ]; do
    case "$line" in "" | "#"*) continue ;; esac
    while :; do
        var=$(printf '%s\n' "$line" | sed -n 's/.*#{\([A-Z_][A-Z0-9_]*\)}.*/\1/p')
        [ -n "$var" ] || break
        eval "password=\${$var:-}"
        if [ -z "$password" ]; then
            echo "deploy/redis/start.sh: set $var (a Redis user's password; see docs/security.md)" >&2
            exit 1
        fi
        used="$used $var"
        hash=$(printf '%s' "$password" | sha256sum | cut -d' ' -f1)
        line=$(printf '%s\n' "$line" | sed "s/#{$var}/#$hash/")
    done
    printf '%s\n' "$line" >>"$acl"
done <"$template"
for var in $used; do unset "$var"; done
# REDISCLI_AUTH: the healthcheck's redis-cli reads it from the container's configuration, not from this process
unset password REDISCLI_AUTH
exec "${REDIS_SERVER:-redis-server}" "$@" --aclfile "$acl"
