/*
 * A fake CUDA MPS for the test lab: ONE binary that a lab host installs, root's and 0755,
 * under the two names of the real ones, nvidia-cuda-mps-control and nvidia-cuda-mps-server.
 * What it does is what the H200 recording shows (tests/fixtures/real-h200/clean-cases/
 * probe-1.log part C):
 *
 *   nvidia-cuda-mps-control -d   the control daemon: the started process forks, the child
 *                                (ppid becomes the host's init) opens and maps /dev/nvidiaN and
 *                                /dev/nvidiactl (no nvidia-uvm), starts its server as a child
 *                                and waits; the first process exits 0 once it runs
 *   nvidia-cuda-mps-server       the server, started by the daemon with argv
 *                                {"nvidia-cuda-mps-server", ""} (recorded cmdline
 *                                'nvidia-cuda-mps-server\x00\x00'): opens every NVIDIA device
 *                                file like CUDA, maps nvidiactl, nvidia-uvm and its GPUs'
 *                                nvidiaN, and holds its memory as a fakecuda holder does (a
 *                                record in $FAKEGPU_ROOT/procs: the fake nvidia-smi and NVML
 *                                list it)
 *   nvidia-cuda-mps-control      the control client: commands on stdin, answers on stdout:
 *                                get_server_list (the server's PID), get_client_list PID (its
 *                                live clients' PIDs), quit (waits while any client is alive,
 *                                then ends the daemon, which ends its server)
 *
 * Both names give the comm "nvidia-cuda-mps" (the kernel cuts it at 15 bytes), as recorded.
 * The real daemon and client talk over a socket in CUDA_MPS_PIPE_DIRECTORY (default
 * /tmp/nvidia-mps; recorded there: control and control_privileged sockets, control_lock, a log
 * FIFO and nvidia-cuda-mps-control.pid, tests/fixtures/real-h200/clean-cases/
 * probe-mps-agent.log); this fake writes the pid file too, and its client answers from the
 * daemon's state in that directory: fakemps.state ("DAEMON_PID SERVER_PID SERVER_STARTTIME")
 * and one file per client in fakemps-clients/ (named by PID, holding its start time;
 * tests/lab/fakecuda.py --mps-pipe writes it). The mode is chosen by the name of the running
 * binary (/proc/self/exe).
 *
 * Environment (the lab sets it): FAKEGPU_ROOT (/run/fakegpu), FAKEMPS_DAEMON_MAP and
 * FAKEMPS_SERVER_MAP (minors of the /dev/nvidiaN each maps, "0,1"), FAKEMPS_SERVER_ALLOC
 * (the server's memory, "INDEX:MIB,..."; nothing when empty).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define STATE "fakemps.state"
#define CLIENTS "fakemps-clients"

static const char *env_or(const char *name, const char *dflt) {
    const char *v = getenv(name);
    return v && *v ? v : dflt;
}

static const char *pipe_dir(void) { return env_or("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"); }

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* State letter and start time (clock ticks since boot) of a process; 0 when it is gone. */
static int proc_stat(long pid, char *state, unsigned long long *start) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return 0;
    p += 2;
    *state = *p;
    for (int field = 3; field < 22 && p; field++) p = strchr(p + 1, ' ');
    *start = p ? strtoull(p + 1, NULL, 10) : 0;
    return 1;
}

static int alive(long pid, unsigned long long start) {
    char state = 0;
    unsigned long long now = 0;
    return pid > 0 && proc_stat(pid, &state, &now) && state != 'Z' && state != 'X' &&
           (start == 0 || now == start);
}

/* Map one byte of a device file, as a CUDA context maps the real ones (kept open). */
static int open_dev(const char *name, int map) {
    char path[64];
    snprintf(path, sizeof path, "/dev/%s", name);
    int fd = open(path, O_RDWR | O_CLOEXEC); /* the server opens its own */
    if (fd < 0) return -1;
    if (map && mmap(NULL, 1, PROT_READ, MAP_SHARED, fd, 0) == MAP_FAILED) return -1;
    return 0;
}

/* Open (and map) /dev/nvidiaM for each minor in a comma list. */
static int open_minors(const char *list, int map) {
    char buf[256], *save = NULL;
    snprintf(buf, sizeof buf, "%s", list);
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        char name[32];
        snprintf(name, sizeof name, "nvidia%d", atoi(t));
        if (open_dev(name, map) < 0) return -1;
    }
    return 0;
}

/* Every /dev/nvidiaN once, as CUDA opens them all (recorded/h200-two-gpus.log). */
static void open_every_gpu(void) {
    DIR *d = opendir("/dev");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        const char *s = e->d_name + 6;
        if (strncmp(e->d_name, "nvidia", 6) || !*s || strspn(s, "0123456789") != strlen(s)) continue;
        open_dev(e->d_name, 0);
    }
    if (d) closedir(d);
}

static int write_file(const char *path, const char *text, mode_t mode) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    fputs(text, f);
    if (fclose(f) != 0 || chmod(tmp, mode) != 0 || rename(tmp, path) != 0) return -1;
    return 0;
}

/* --- the server -------------------------------------------------------------------------- */

static int server_main(void) {
    if (open_dev("nvidiactl", 1) < 0 || open_dev("nvidia-uvm", 1) < 0 ||
        open_minors(env_or("FAKEMPS_SERVER_MAP", "0"), 1) < 0)
        return 1;
    open_every_gpu();
    char alloc[512] = "", buf[256], *save = NULL;
    snprintf(buf, sizeof buf, "%s", env_or("FAKEMPS_SERVER_ALLOC", ""));
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int idx = 0;
        long mib = 0;
        if (sscanf(t, "%d:%ld", &idx, &mib) != 2) return 1;
        size_t used = strlen(alloc);
        snprintf(alloc + used, sizeof alloc - used, "%s\"%d\": %ld", used ? ", " : "", idx, mib);
    }
    char state = 0, path[4200], doc[1024];
    unsigned long long start = 0;
    proc_stat(getpid(), &state, &start);
    snprintf(path, sizeof path, "%s/procs/%d.json", env_or("FAKEGPU_ROOT", "/run/fakegpu"),
             (int)getpid());
    snprintf(doc, sizeof doc, "{\"pid\": %d, \"starttime\": %llu, \"alloc\": {%s}}\n",
             (int)getpid(), start, alloc);
    if (*alloc && write_file(path, doc, 0666) < 0) return 1;
    for (;;) pause();
}

/* --- the daemon --------------------------------------------------------------------------- */

static volatile sig_atomic_t g_quit;
static void on_term(int sig) { (void)sig; g_quit = 1; }

static long start_server(void) {
    char self[4096], path[4200];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return -1;
    self[n] = 0;
    char *slash = strrchr(self, '/');
    if (!slash) return -1;
    *slash = 0;
    snprintf(path, sizeof path, "%s/nvidia-cuda-mps-server", self);
    pid_t pid = fork();
    if (pid == 0) {
        char *argv[] = {"nvidia-cuda-mps-server", "", NULL};
        execv(path, argv);
        _exit(127);
    }
    return pid;
}

/* The daemon proper (the forked child): devices, server, state file; "ok" on the pipe. */
static int daemon_run(int ready) {
    setsid();
    int null = open("/dev/null", O_RDWR); /* nothing of the starter's is kept open */
    dup2(null, 0), dup2(null, 1), dup2(null, 2);
    char dir[4096], state_path[4200], clients[4200], text[128];
    snprintf(dir, sizeof dir, "%s", pipe_dir());
    snprintf(state_path, sizeof state_path, "%s/" STATE, dir);
    snprintf(clients, sizeof clients, "%s/" CLIENTS, dir);
    if (mkdir(dir, 0755) < 0 && errno != EEXIST) return 1;
    if (mkdir(clients, 01777) < 0 && errno != EEXIST) return 1;
    chmod(clients, 01777); /* clients of any user register here */
    if (open_dev("nvidiactl", 1) < 0 || open_minors(env_or("FAKEMPS_DAEMON_MAP", "0"), 1) < 0)
        return 1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    long server = start_server();
    char st = 0;
    unsigned long long start = 0;
    for (int i = 0; i < 500 && server > 0; i++) { /* its record written: it holds memory */
        proc_stat(server, &st, &start);
        snprintf(text, sizeof text, "%s/procs/%ld.json", env_or("FAKEGPU_ROOT", "/run/fakegpu"),
                 server);
        if (!*env_or("FAKEMPS_SERVER_ALLOC", "") || access(text, F_OK) == 0) break;
        sleep_ms(10);
    }
    if (server <= 0 || !alive(server, start)) return 1;
    snprintf(text, sizeof text, "%d %ld %llu\n", (int)getpid(), server, start);
    if (write_file(state_path, text, 0644) < 0) return 1;
    snprintf(state_path, sizeof state_path, "%s/nvidia-cuda-mps-control.pid", dir);
    snprintf(text, sizeof text, "%d\n", (int)getpid());
    if (write_file(state_path, text, 0666) < 0) return 1; /* as the real one (recorded) */
    snprintf(state_path, sizeof state_path, "%s/" STATE, dir);
    if (write(ready, "ok", 2) != 2) return 1;
    close(ready);
    while (!g_quit) {
        if (waitpid(-1, NULL, WNOHANG) == server) server = -1; /* a server that died */
        sleep_ms(50);
    }
    if (server > 0) {
        kill((pid_t)server, SIGTERM);
        waitpid((pid_t)server, NULL, 0);
    }
    unlink(state_path);
    return 0;
}

static int daemon_main(void) {
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) < 0) return 1; /* the server never holds it */
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
        close(fds[0]);
        _exit(daemon_run(fds[1]));
    }
    close(fds[1]);
    char buf[2];
    if (read(fds[0], buf, 2) != 2) {
        fprintf(stderr, "fakemps: the control daemon did not start\n");
        return 1;
    }
    return 0;
}

/* --- the control client -------------------------------------------------------------------- */

static int read_state(long *daemon, long *server, unsigned long long *start) {
    char path[4200];
    snprintf(path, sizeof path, "%s/" STATE, pipe_dir());
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int ok = fscanf(f, "%ld %ld %llu", daemon, server, start) == 3;
    fclose(f);
    return ok && alive(*daemon, 0);
}

static int cmp_long(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return x < y ? -1 : x > y;
}

/* Live clients' PIDs (sorted), at most max. */
static int live_clients(long *out, int max) {
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/" CLIENTS, pipe_dir());
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    while (d && n < max && (e = readdir(d))) {
        if (strspn(e->d_name, "0123456789") != strlen(e->d_name) || !*e->d_name) continue;
        char path[4500];
        unsigned long long start = 0;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        int ok = fscanf(f, "%llu", &start) == 1;
        fclose(f);
        long pid = atol(e->d_name);
        if (ok && alive(pid, start)) out[n++] = pid;
    }
    if (d) closedir(d);
    qsort(out, (size_t)n, sizeof(long), cmp_long);
    return n;
}

static int command(const char *line, long daemon, long server, unsigned long long start) {
    long clients[256];
    if (!strcmp(line, "get_server_list")) {
        if (alive(server, start)) printf("%ld\n", server);
    } else if (!strncmp(line, "get_client_list ", 16)) {
        if (atol(line + 16) == server && alive(server, start)) {
            int n = live_clients(clients, 256);
            for (int i = 0; i < n; i++) printf("%ld\n", clients[i]);
        }
    } else if (!strcmp(line, "quit")) {
        while (live_clients(clients, 1) > 0) sleep_ms(20); /* recorded: waits for clients */
        kill((pid_t)daemon, SIGTERM);
        for (int i = 0; i < 250 && alive(daemon, 0); i++) sleep_ms(20);
    } else if (*line) {
        fprintf(stderr, "fakemps: unknown command: %s\n", line);
        return 1;
    }
    fflush(stdout);
    return 0;
}

static int client_main(void) {
    long daemon = 0, server = 0;
    unsigned long long start = 0;
    if (!read_state(&daemon, &server, &start)) {
        fprintf(stderr, "fakemps: no MPS control daemon answers in %s\n", pipe_dir());
        return 1;
    }
    char line[512];
    int rc = 0;
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\r\n")] = 0;
        rc |= command(line, daemon, server, start);
    }
    return rc;
}

int main(int argc, char **argv) {
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return 1;
    self[n] = 0;
    const char *name = strrchr(self, '/') ? strrchr(self, '/') + 1 : self;
    if (!strcmp(name, "nvidia-cuda-mps-server")) return server_main();
    if (argc > 1 && !strcmp(argv[1], "-d")) return daemon_main();
    return client_main();
}
