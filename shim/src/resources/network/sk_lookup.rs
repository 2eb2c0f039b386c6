//! A BPF `sk_lookup` program on the pod netns that hands every TCP connection to 127.0.0.1, on
//! any port, to one listening socket of the shim (kernel 5.9 or later). The program, a SOCKMAP
//! holding the socket and the link that attaches the program to the netns are kernel objects
//! that live as long as their fds: dropping [`LoopbackRedirect`] (or the shim's death, kill -9
//! included) detaches the program, so there is nothing to record or undo.
//!
//! The accepted connection's local address is the one containerd dialed (`127.0.0.1:<port>`),
//! which is how the shim learns the port. The program (hand-assembled, 23 instructions):
//!
//! ```text
//!  if ctx->protocol != TCP || ctx->family != AF_INET || ctx->local_ip4 != 127.0.0.1: pass
//!  sk = map_lookup(sockmap, 0); if !sk: pass
//!  sk_assign(ctx, sk, 0); sk_release(sk); pass
//! ```
//!
//! "pass" lets the kernel's own lookup go on, so a failed assignment is an ordinary refused
//! connection. Why by hand, through `bpf(2)`: the program is fixed and tiny; aya loads only
//! compiled ELF objects (a BPF toolchain in the build), libbpf-sys adds a C library and libelf
//! for the same four calls.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;

const BPF_MAP_TYPE_SOCKMAP: u32 = 15;
const BPF_PROG_TYPE_SK_LOOKUP: u32 = 30;
const BPF_SK_LOOKUP: u32 = 36;
const BPF_PSEUDO_MAP_FD: u8 = 1;

const FUNC_MAP_LOOKUP_ELEM: i32 = 1;
const FUNC_SK_RELEASE: i32 = 86;
const FUNC_SK_ASSIGN: i32 = 124;

/// `struct bpf_sk_lookup` offsets (uapi linux/bpf.h).
const CTX_FAMILY: i16 = 8;
const CTX_PROTOCOL: i16 = 12;
const CTX_LOCAL_IP4: i16 = 40;

const SK_PASS: i32 = 1;
/// 127.0.0.1 as the context holds it (network order) read as a little-endian u32.
const LOOPBACK_IP4: i32 = i32::from_ne_bytes([127, 0, 0, 1]);

/// Bytes of the verifier's log kept for an error.
const LOG_SIZE: usize = 16 * 1024;

/// One BPF instruction (`struct bpf_insn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
struct Insn {
    code: u8,
    /// dst in the low nibble, src in the high one.
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: (src << 4) | (dst & 0xf),
        off,
        imm,
    }
}

// Opcodes: class | op | source.
const MOV64_REG: u8 = 0x07 | 0xb0 | 0x08; // BPF_ALU64 | BPF_MOV | BPF_X
const MOV64_IMM: u8 = 0x07 | 0xb0; // BPF_ALU64 | BPF_MOV | BPF_K
const ADD64_IMM: u8 = 0x07; // BPF_ALU64 | BPF_ADD | BPF_K
const LDX_W: u8 = 0x01 | 0x60; // BPF_LDX | BPF_MEM | BPF_W
const ST_W: u8 = 0x02 | 0x60; // BPF_ST | BPF_MEM | BPF_W
const LD_IMM64: u8 = 0x18; // BPF_LD | BPF_DW | BPF_IMM
const JNE_IMM: u8 = 0x05 | 0x50; // BPF_JMP | BPF_JNE | BPF_K
const JEQ_IMM: u8 = 0x05 | 0x10; // BPF_JMP | BPF_JEQ | BPF_K
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;

/// The program, with the SOCKMAP's fd in its map load.
fn program(map_fd: i32) -> Vec<Insn> {
    // Jump offsets count instructions after the jump; `PASS` is the index of `r0 = SK_PASS`.
    const PASS: i16 = 21;
    let to_pass = |at: i16| PASS - at - 1;
    vec![
        insn(MOV64_REG, 6, 1, 0, 0),                        // 0: r6 = ctx
        insn(LDX_W, 2, 6, CTX_PROTOCOL, 0),                 // 1: r2 = ctx->protocol
        insn(JNE_IMM, 2, 0, to_pass(2), libc::IPPROTO_TCP), // 2
        insn(LDX_W, 2, 6, CTX_FAMILY, 0),                   // 3: r2 = ctx->family
        insn(JNE_IMM, 2, 0, to_pass(4), libc::AF_INET),     // 4
        insn(LDX_W, 2, 6, CTX_LOCAL_IP4, 0),                // 5: r2 = ctx->local_ip4
        insn(JNE_IMM, 2, 0, to_pass(6), LOOPBACK_IP4),      // 6
        insn(ST_W, 10, 0, -4, 0),                           // 7: key = 0 on the stack
        insn(MOV64_REG, 2, 10, 0, 0),                       // 8: r2 = fp
        insn(ADD64_IMM, 2, 0, 0, -4),                       // 9: r2 = &key
        insn(LD_IMM64, 1, BPF_PSEUDO_MAP_FD, 0, map_fd),    // 10: r1 = map
        insn(0, 0, 0, 0, 0),                                // 11: (second half)
        insn(CALL, 0, 0, 0, FUNC_MAP_LOOKUP_ELEM),          // 12: r0 = sk or NULL
        insn(JEQ_IMM, 0, 0, to_pass(13), 0),                // 13
        insn(MOV64_REG, 7, 0, 0, 0),                        // 14: r7 = sk
        insn(MOV64_REG, 1, 6, 0, 0),                        // 15: r1 = ctx
        insn(MOV64_REG, 2, 7, 0, 0),                        // 16: r2 = sk
        insn(MOV64_IMM, 3, 0, 0, 0),                        // 17: r3 = 0 (flags)
        insn(CALL, 0, 0, 0, FUNC_SK_ASSIGN),                // 18
        insn(MOV64_REG, 1, 7, 0, 0),                        // 19: r1 = sk
        insn(CALL, 0, 0, 0, FUNC_SK_RELEASE),               // 20
        insn(MOV64_IMM, 0, 0, 0, SK_PASS),                  // 21: PASS
        insn(EXIT, 0, 0, 0, 0),                             // 22
    ]
}

/// Why the redirect could not be set up (each names the `bpf(2)` command).
#[derive(Debug, thiserror::Error)]
pub enum SkLookupError {
    #[error("creating the SOCKMAP: {0}")]
    MapCreate(io::Error),
    #[error("putting the listening socket in the SOCKMAP: {0}")]
    MapUpdate(io::Error),
    #[error("loading the sk_lookup program: {source}{}", verifier_log(.log))]
    ProgLoad { source: io::Error, log: String },
    #[error("attaching the sk_lookup program to the pod netns: {0}")]
    LinkCreate(io::Error),
}

fn verifier_log(log: &str) -> String {
    if log.trim().is_empty() {
        String::new()
    } else {
        format!(" (verifier: {})", log.trim().replace('\n', "; "))
    }
}

/// The attached program; dropping it detaches it.
#[derive(Debug)]
pub struct LoopbackRedirect {
    _map: OwnedFd,
    _prog: OwnedFd,
    _link: OwnedFd,
}

/// `bpf(cmd, attr, size_of attr)`; a non-negative result is an fd when `cmd` makes one.
///
/// # Safety
/// `attr` must be the attribute struct of `cmd`, every pointer in it valid for the call.
unsafe fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: the caller's contract: `attr` is `cmd`'s attribute layout, of its size, with
    // valid pointers; the kernel reads (and for some commands writes) only that much.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            (attr as *mut T).cast::<libc::c_void>(),
            std::mem::size_of::<T>(),
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn owned_fd(rc: libc::c_long) -> io::Result<OwnedFd> {
    let fd = i32::try_from(rc).map_err(|_| io::Error::other(format!("bpf returned {rc}")))?;
    // SAFETY: the command returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[repr(C)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
}

#[repr(C)]
struct MapUpdateAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

#[repr(C)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
}

fn fd_u32(fd: BorrowedFd<'_>) -> u32 {
    // An open fd is never negative.
    u32::try_from(fd.as_raw_fd()).unwrap_or(u32::MAX)
}

/// Attaches the redirect to the netns `netns` (an fd of `/proc/<pid>/ns/net` or its bind
/// mount): TCP connections to 127.0.0.1 there go to `listener`, a listening TCP socket created
/// in that netns.
pub fn redirect_loopback(
    netns: BorrowedFd<'_>,
    listener: BorrowedFd<'_>,
) -> Result<LoopbackRedirect, SkLookupError> {
    let mut map_attr = MapCreateAttr {
        map_type: BPF_MAP_TYPE_SOCKMAP,
        key_size: 4,
        value_size: 8,
        max_entries: 1,
        map_flags: 0,
    };
    // SAFETY: BPF_MAP_CREATE's leading fields; no pointers.
    let map = unsafe { bpf(BPF_MAP_CREATE, &mut map_attr) }
        .and_then(owned_fd)
        .map_err(SkLookupError::MapCreate)?;

    let key: u32 = 0;
    let value: u64 = u64::from(fd_u32(listener));
    let mut update = MapUpdateAttr {
        map_fd: fd_u32(map.as_fd()),
        _pad: 0,
        key: &key as *const u32 as u64,
        value: &value as *const u64 as u64,
        flags: 0,
    };
    // SAFETY: BPF_MAP_UPDATE_ELEM's fields; key and value point at live locals of the map's
    // key and value sizes.
    unsafe { bpf(BPF_MAP_UPDATE_ELEM, &mut update) }.map_err(SkLookupError::MapUpdate)?;

    let insns = program(map.as_raw_fd());
    let license = c"Apache-2.0";
    let mut log = vec![0u8; LOG_SIZE];
    let mut name = [0u8; 16];
    name[..11].copy_from_slice(b"mvm_forward");
    let mut load = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_SK_LOOKUP,
        insn_cnt: u32::try_from(insns.len()).unwrap_or(u32::MAX),
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: u32::try_from(log.len()).unwrap_or(0),
        log_buf: log.as_mut_ptr() as u64,
        kern_version: 0,
        prog_flags: 0,
        prog_name: name,
        prog_ifindex: 0,
        expected_attach_type: BPF_SK_LOOKUP,
    };
    // SAFETY: BPF_PROG_LOAD's fields up to expected_attach_type; insns, license and the log
    // buffer point at live values of the lengths given.
    let prog = match unsafe { bpf(BPF_PROG_LOAD, &mut load) }.and_then(owned_fd) {
        Ok(fd) => fd,
        Err(source) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            return Err(SkLookupError::ProgLoad {
                source,
                log: String::from_utf8_lossy(&log[..end]).into_owned(),
            });
        }
    };

    let mut link = LinkCreateAttr {
        prog_fd: fd_u32(prog.as_fd()),
        target_fd: fd_u32(netns),
        attach_type: BPF_SK_LOOKUP,
        flags: 0,
    };
    // SAFETY: BPF_LINK_CREATE's leading fields; no pointers.
    let link = unsafe { bpf(BPF_LINK_CREATE, &mut link) }
        .and_then(owned_fd)
        .map_err(SkLookupError::LinkCreate)?;
    Ok(LoopbackRedirect {
        _map: map,
        _prog: prog,
        _link: link,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_program_jumps_land_on_pass_and_it_ends_with_exit() {
        let p = program(7);
        assert_eq!(p.len(), 23);
        assert_eq!(p[21], insn(MOV64_IMM, 0, 0, 0, SK_PASS));
        assert_eq!(p[22].code, EXIT);
        for (at, i) in p.iter().enumerate() {
            if i.code == JNE_IMM || i.code == JEQ_IMM {
                let target = at as i64 + 1 + i64::from(i.off);
                assert_eq!(target, 21, "jump at {at}");
            }
        }
        // The map load carries the fd, marked as a map fd.
        assert_eq!((p[10].code, p[10].regs >> 4, p[10].imm), (LD_IMM64, 1, 7));
        assert_eq!(LOOPBACK_IP4.to_ne_bytes(), [127, 0, 0, 1]);
        assert_eq!(std::mem::size_of::<Insn>(), 8);
        assert_eq!(std::mem::size_of::<ProgLoadAttr>(), 72);
        assert_eq!(std::mem::size_of::<MapUpdateAttr>(), 32);
    }
}
