//! A hostile tenant's GPU process, as a real process whose `/proc` the
//! daemon reads: a name that is not UTF-8, a leader thread that exits while
//! a worker holds on, a mount namespace of its own with the container's
//! state directory, and thousands of mounts beside it.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

const SOURCE: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

static int drop_slot = 0;
static long relock = -1;

/* Waits for a line on stdin; then, with --drop, lets go of the slot's
   record lock (closing any descriptor of a file drops the process's locks
   on it) and holds on; with --relock OFFSET, takes the lock at OFFSET again
   for 50 ms in every second, so that it held its slot at a recent sample. */
static void *worker(void *arg) {
    char line[16];
    (void)arg;
    if (drop_slot && fgets(line, sizeof line, stdin)) {
        int fd = open("/run/gpumem/accounting", O_RDWR);
        if (fd >= 0) close(fd);
        while (relock >= 0) {
            usleep(950 * 1000);
            fd = open("/run/gpumem/accounting", O_RDWR);
            struct flock lock = {.l_type = F_WRLCK, .l_whence = SEEK_SET,
                                 .l_start = relock, .l_len = 1};
            fcntl(fd, F_SETLK, &lock);
            usleep(50 * 1000);
            close(fd);
        }
    }
    for (;;) pause();
    return NULL;
}

static void die(const char *what) { perror(what); exit(1); }

int main(int argc, char **argv) {
    int leader_exits = 0, cuda = 0, stack = 0;
    const char *state = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mount")) state = argv[++i];
        else if (!strcmp(argv[i], "--mounts")) stack = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--name"))
            prctl(PR_SET_NAME, "gpu\xff\xfe", 0, 0, 0);
        else if (!strcmp(argv[i], "--cuda")) cuda = 1;
        else if (!strcmp(argv[i], "--leader-exits")) leader_exits = 1;
        else if (!strcmp(argv[i], "--drop")) drop_slot = 1;
        else if (!strcmp(argv[i], "--relock")) relock = atol(argv[++i]);
    }
    if (state) {
        /* A container's view: the state directory at /run/gpumem. */
        if (unshare(CLONE_NEWNS)) die("unshare");
        if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) die("private");
        if (mount("tenant-run", "/run", "tmpfs", 0, NULL)) die("/run");
        mkdir("/run/gpumem", 0755);
        if (mount(state, "/run/gpumem", NULL, MS_BIND, NULL)) die("bind");
    }
    if (stack) {
        /* One directory with a long path, bound again and again onto
           directories inside it: each mount adds a line of two long
           paths. */
        char path[4096] = "/run/stack";
        mkdir(path, 0755);
        for (int depth = 0; depth < 16; depth++) {
            size_t at = strlen(path);
            path[at] = '/';
            memset(path + at + 1, 'd', 200);
            path[at + 201] = 0;
            if (mkdir(path, 0755)) die("mkdir");
        }
        for (int i = 0; i < stack; i++) {
            char point[4200];
            snprintf(point, sizeof point, "%s/%d", path, i);
            if (mkdir(point, 0755)) die("mkdir");
            if (mount(path, point, NULL, MS_BIND, NULL)) die("mounts");
        }
    }
    if (cuda) {
        typedef int (*fn)();
        void *ctx;
        if (!dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL)) die("libcuda");
        ((fn)dlsym(RTLD_DEFAULT, "cuInit"))(0);
        if (((fn)dlsym(RTLD_DEFAULT, "cuDevicePrimaryCtxRetain"))(&ctx, 0)) die("context");
    }
    pthread_t thread;
    if (pthread_create(&thread, NULL, worker, NULL)) die("thread");
    printf("ready\n");
    fflush(stdout);
    if (leader_exits) pthread_exit(NULL);
    for (;;) pause();
}
"#;

/// The tenant program, built once per test binary.
pub fn tenant() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            // Under the target directory: it outlives the test binary.
            let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("tenant-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            super::compile_c(SOURCE, &dir)
        })
        .clone()
}

/// `tenant` with `args`, its stdin and stdout piped, once it is ready.
pub fn start(args: &[&str]) -> super::Killed {
    let mut child = std::process::Command::new(tenant())
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    super::wait_for_line(&mut child, "ready");
    super::Killed(child)
}
