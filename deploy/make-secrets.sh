#!/bin/sh
# Generate the secrets a toolchord cluster needs, one value per file, into DIR (default ./secrets).
#
#   deploy/make-secrets.sh [DIR] [REDIS_HOST]
#
# Files written (names double as Kubernetes Secret keys, see docs/deployment.md):
#   redis-username      ACL user the workers, orchestrators and Flower log in as
#   redis-password      its password
#   redis-users.acl     Redis ACL file: the default user is disabled, only that user may log in
#   redis-url           redis://user:password@REDIS_HOST:6379/0 for TOOLCHORD_BROKER_URL_FILE
#   flower-basic-auth   user:password for Flower's basic auth (FLOWER_BASIC_AUTH)
#
# The directory is created mode 700 so other host users cannot read it. The files inside are
# mode 644 on purpose: Docker Compose bind-mounts file secrets with their host permissions, and the
# containers read them as non-root users (uid 10001 for toolchord, 999 for Redis) that do not own
# them. A root worker (deploy/compose/uid-drop.override.yml) mounts this directory itself instead:
# its mode 700 keeps the sandbox's per-call uids out. Existing files are never overwritten, so
# re-running keeps the cluster's passwords.
set -eu

dir="${1:-secrets}"
redis_host="${2:-redis}"
redis_user="toolchord"

random_token() {
    # 32 alphanumeric characters: safe inside URLs and ACL rules without escaping.
    LC_ALL=C tr -dc 'A-Za-z0-9' </dev/urandom | head -c 32
}

write_new() {
    # write_new FILE VALUE: create FILE with VALUE unless it exists.
    if [ -e "$1" ]; then
        echo "kept    $1"
    else
        printf '%s' "$2" >"$1"
        chmod 644 "$1"
        echo "created $1"
    fi
}

umask 077
mkdir -p "$dir"
chmod 700 "$dir"

write_new "$dir/redis-username" "$redis_user"
write_new "$dir/redis-password" "$(random_token)"
redis_password="$(cat "$dir/redis-password")"

# Redis ACL: no anonymous/default access; one user with every key and channel. Administrative and
# dangerous commands (CONFIG, FLUSHALL, DEBUG, KEYS, ...) are not needed by Celery or toolchord.
write_new "$dir/redis-users.acl" "user default off
user $redis_user on >$redis_password ~* &* +@all -@admin -@dangerous
"
write_new "$dir/redis-url" "redis://$redis_user:$redis_password@$redis_host:6379/0"
write_new "$dir/flower-basic-auth" "admin:$(random_token)"
