#!/usr/bin/env bash
# Installs (from Debian packages, when missing) and starts PostgreSQL and MariaDB on
# loopback, and creates the role the tests connect as. Idempotent: safe to run again.
#
# The tests read the admin URLs from LAPSE_TEST_POSTGRES_URL / LAPSE_TEST_MYSQL_URL (the
# defaults below match this script) and create and drop their own databases.
set -euo pipefail

TEST_USER="${LAPSE_TEST_DB_USER:-lapse_test}"
TEST_PASSWORD="${LAPSE_TEST_DB_PASSWORD:-lapse_test}"

need=()
command -v pg_ctlcluster >/dev/null || need+=(postgresql)
command -v mariadbd >/dev/null || need+=(mariadb-server)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "databases: ${need[*]} missing and not root; install them with apt-get" >&2
    exit 1
  fi
  echo "databases: installing ${need[*]} from Debian packages" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

as_postgres() { runuser -u postgres -- "$@"; }

# --- PostgreSQL --------------------------------------------------------------------
pg_version=$(ls /etc/postgresql | sort -V | tail -1)
if ! pg_lsclusters -h | awk -v v="$pg_version" '$1 == v && $2 == "main" && $4 == "online"' | grep -q .; then
  pg_ctlcluster --skip-systemctl-redirect "$pg_version" main start
fi
for _ in $(seq 1 60); do
  as_postgres psql -qAtc 'select 1' >/dev/null 2>&1 && break
  sleep 0.5
done
as_postgres psql -qAt -v ON_ERROR_STOP=1 <<SQL >/dev/null
DO \$\$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$TEST_USER') THEN
    CREATE ROLE $TEST_USER LOGIN CREATEDB PASSWORD '$TEST_PASSWORD';
  END IF;
END \$\$;
SQL
echo "databases: PostgreSQL $pg_version ready on 127.0.0.1:5432" >&2

# --- MariaDB -----------------------------------------------------------------------
mysql_ping() { mariadb-admin --protocol=socket ping >/dev/null 2>&1; }
if ! mysql_ping; then
  mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
  start-stop-daemon --start --oknodo --background --chuid mysql \
    --exec /usr/sbin/mariadbd -- --bind-address=127.0.0.1
  for _ in $(seq 1 120); do mysql_ping && break; sleep 0.5; done
  mysql_ping || { echo "databases: MariaDB did not start" >&2; exit 1; }
fi
mariadb --protocol=socket <<SQL
CREATE USER IF NOT EXISTS '$TEST_USER'@'127.0.0.1' IDENTIFIED BY '$TEST_PASSWORD';
CREATE USER IF NOT EXISTS '$TEST_USER'@'localhost' IDENTIFIED BY '$TEST_PASSWORD';
GRANT ALL PRIVILEGES ON *.* TO '$TEST_USER'@'127.0.0.1';
GRANT ALL PRIVILEGES ON *.* TO '$TEST_USER'@'localhost';
FLUSH PRIVILEGES;
SQL
echo "databases: MariaDB $(mariadbd --version | awk '{print $3}') ready on 127.0.0.1:3306" >&2
