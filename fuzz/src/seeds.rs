//! The seed corpus of each target: a few inputs that a real driver or peer would send, in the
//! tape format each target reads, so that fuzzing starts from valid traffic and mutates from
//! there. `scripts/fuzz.sh --write-seeds` writes them into fuzz/seeds/<target>/ (a target
//! started with `MICROVM_FUZZ_WRITE_SEEDS=<dir>` writes its own and exits: see [`write_if_asked`]).
//!
//! One file over 600 lines on purpose: it is data (one short seed builder per target, side by
//! side so a change of the tape format is made in one place), not logic.

use std::path::Path;

use crate::tape::TapeWriter;
use crate::virtq::{write_chain_op, Desc};

/// Writes `seeds` into the directory named by `MICROVM_FUZZ_WRITE_SEEDS`, if set, and exits.
pub fn write_if_asked(seeds: fn() -> Vec<Vec<u8>>) {
    let Some(dir) = std::env::var_os("MICROVM_FUZZ_WRITE_SEEDS") else {
        return;
    };
    let dir = Path::new(&dir);
    for (i, s) in seeds().iter().enumerate() {
        let path = dir.join(format!("seed-{i:02}"));
        if let Err(e) = std::fs::write(&path, s) {
            eprintln!("writing {}: {e}", path.display());
            std::process::exit(1);
        }
    }
    std::process::exit(0);
}

fn pfns(list: &[u32]) -> Vec<u8> {
    list.iter().flat_map(|p| p.to_le_bytes()).collect()
}

/// virtio_balloon: inflate, deflate and a free page report, with and without reporting.
pub fn virtio_balloon() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for reporting in [false, true] {
        let mut w = TapeWriter::new();
        w.bool(reporting).u64(u64::MAX).u8(4).u8(4).u8(4);
        // Inflate pages 0x80..0x84 (in the data region), then serve the inflate queue.
        write_chain_op(
            &mut w,
            0,
            &[Desc::readable(0x100, &pfns(&[0x80, 0x81, 0x82, 0x83]))],
        );
        w.u8(4).u8(0);
        write_chain_op(&mut w, 1, &[Desc::readable(0x200, &pfns(&[0x80, 0x81]))]);
        w.u8(4).u8(1);
        // A free page report: two device-writable blocks.
        write_chain_op(
            &mut w,
            2,
            &[
                Desc::writable(0x4_0000, 0x1_0000),
                Desc::writable(0x6_0000, 0x1000),
            ],
        );
        w.u8(4).u8(2);
        // The driver writes `actual`, reads the config, resets.
        w.u8(5).u8(4).u8(4).u32(4);
        w.u8(6).u64(0).u8(8);
        w.u8(7).u64(u64::MAX);
        out.push(w.finish());
    }
    out
}

fn block_request(w: &mut TapeWriter, type_: u8, sector: u8, segments: &[Result<Vec<u8>, u16>]) {
    w.u8(4).u8(type_).u8(sector).u8(segments.len() as u8);
    for s in segments {
        match s {
            Ok(data) => {
                w.u8(0).blob(data);
            }
            Err(len) => {
                w.u8(1).u16(*len);
            }
        }
    }
}

/// virtio_blk: write, read back, flush, get-id, discard and write-zeroes, attach/detach.
pub fn virtio_blk() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for read_only in [false, true] {
        let mut w = TapeWriter::new();
        w.bool(read_only)
            .u64(u64::MAX)
            .u8(4)
            .u8(16)
            .u8(8)
            .bool(false);
        block_request(&mut w, 1, 2, &[Ok(vec![0xab; 1024])]);
        block_request(&mut w, 0, 2, &[Err(512), Err(512)]);
        block_request(&mut w, 2, 0, &[]);
        block_request(&mut w, 3, 0, &[Err(20)]);
        let mut range = Vec::new();
        range.extend_from_slice(&4u64.to_le_bytes());
        range.extend_from_slice(&2u32.to_le_bytes());
        range.extend_from_slice(&0u32.to_le_bytes());
        block_request(&mut w, 4, 0, &[Ok(range.clone())]);
        block_request(&mut w, 5, 0, &[Ok(range)]);
        // Detach, attach the other disk.
        w.u8(7).u8(7).u8(1);
        block_request(&mut w, 0, 0, &[Err(4096)]);
        w.u8(8).u8(0).u8(8).u8(0).u8(0);
        out.push(w.finish());
    }
    out
}

/// virtio_net: frames both ways, a full backend, a hang-up.
pub fn virtio_net() -> Vec<Vec<u8>> {
    let mut w = TapeWriter::new();
    w.u16(1500).u8(0).u64(u64::MAX).u8(4).u8(4);
    let mut frame = vec![0xffu8; 6];
    frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 1, 0x08, 0x00]);
    frame.extend_from_slice(&[0x45; 46]);
    for split in [false, true] {
        w.u8(4).bytes(&[0u8; 12]).blob(&frame).bool(split);
    }
    w.u8(6).u8(0).u16(1526);
    w.u8(7).blob(&[[0u8; 12].as_slice(), &frame].concat());
    w.u8(9).u8(1);
    w.u8(6).u8(2).u16(12).u16(14).u16(1500);
    w.u8(7).blob(&[0u8; 9000]);
    w.u8(9).u8(3);
    w.u8(8);
    w.u8(10).u8(12).u8(0).u8(0).u8(0);
    let mut hangup = w.clone();
    hangup.u8(9).u8(0x80);
    vec![w.finish(), hangup.finish()]
}

/// virtio_mmio: a driver's whole set-up, a notify and the device's work, then odd accesses.
pub fn virtio_mmio() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for block in [false, true] {
        let mut w = TapeWriter::new();
        w.bool(block);
        if !block {
            w.bool(true);
        }
        for _ in 0..if block { 1 } else { 3 } {
            w.u8(4);
        }
        w.u8(7).u64(u64::MAX);
        if block {
            let mut header = Vec::new();
            header.extend_from_slice(&0u32.to_le_bytes());
            header.extend_from_slice(&0u32.to_le_bytes());
            header.extend_from_slice(&0u64.to_le_bytes());
            write_chain_op(
                &mut w,
                0,
                &[
                    Desc::readable(0x100, &header),
                    Desc::writable(0x1000, 512),
                    Desc::writable(0x2000, 1),
                ],
            );
        } else {
            write_chain_op(&mut w, 0, &[Desc::readable(0x100, &pfns(&[0x90]))]);
        }
        w.u8(9).u32(0).u8(8);
        // Reads of every register, a misaligned write, a status reset.
        for r in 0..26u8 {
            w.u8(6).u8(r).u8(0);
        }
        w.u8(4).u8(0x80).u16(0x71).u8(0).bytes(&[1, 0, 0, 0]);
        w.u8(10).u8(11).u32(0);
        out.push(w.finish());
    }
    out
}

/// pci_config: the guest's probe of bus 0, sizing and moving BARs, decoding on, BAR accesses.
pub fn pci_config() -> Vec<Vec<u8>> {
    let mut w = TapeWriter::new();
    for slot in 0..4u8 {
        for reg in [0u8, 4, 8, 0x0c, 0x10, 0x14, 0x18, 0x2c, 0x30, 0x34, 0x3c] {
            w.u8(0).u8(slot).u8(reg).u8(3).u8(4).u8(2);
        }
    }
    for bar in 0..6u8 {
        w.u8(4).u8(0).u8(bar).u8(0);
        w.u8(4).u8(0).u8(bar).u8(1).u16(0x100);
    }
    w.u8(5).u8(0).u8(3);
    w.u8(6).u32(0x1000).u8(2).bool(true);
    w.u8(6).u32(0x10).u8(1).bool(false);
    w.u8(0).u8(1).u8(0x3c).u8(1).u8(0).u8(0).bytes(&[0x0b]);
    w.u8(7);
    vec![w.finish()]
}

/// vsock header fields for the structured packet operation (op 4).
#[allow(clippy::too_many_arguments)]
fn vsock_packet(
    w: &mut TapeWriter,
    src: u8,
    dst: u8,
    op: u8,
    flags: u8,
    buf_alloc: u32,
    data: &[u8],
) {
    w.u8(4)
        .u8(0)
        .u8(src)
        .u8(dst)
        .u8(op)
        .u8(flags)
        .u32(buf_alloc)
        .u32(0)
        .blob(data);
}

/// vsock reply to the last received packet (op 5): RESPONSE=0, RW=1, CREDIT_UPDATE=2,
/// CREDIT_REQUEST=3; `special` 0 = SHUTDOWN, 1 = RST, else the first.
fn vsock_reply(w: &mut TapeWriter, op: u8, special: u8, flags: u8, data: &[u8]) {
    w.u8(5).u8(op).u8(special).u8(flags).u32(256 * 1024).u32(0);
    if op == 1 && special > 1 {
        w.blob(data);
    }
}

/// virtio_vsock: a guest-initiated and a host-initiated connection, with data both ways,
/// credit, shutdown and reset.
pub fn virtio_vsock() -> Vec<Vec<u8>> {
    let rx = |w: &mut TapeWriter| {
        w.u8(6).u8(3);
        for _ in 0..4 {
            w.u16(44 + 4096);
        }
    };
    // Guest to host: port 7 -> host 1026, which listens.
    let mut g = TapeWriter::new();
    g.u8(7).u8(6).u8(6).u8(6);
    rx(&mut g);
    g.u8(12).u8(1);
    vsock_packet(&mut g, 3, 1, 1, 0, 256 * 1024, b"");
    g.u8(13).u8(7);
    vsock_packet(&mut g, 3, 1, 5, 0, 256 * 1024, b"ready\n");
    g.u8(10).u8(0).u8(9).u8(0).blob(b"reply from the host");
    g.u8(7);
    rx(&mut g);
    vsock_packet(&mut g, 3, 1, 7, 0, 256 * 1024, b"");
    vsock_packet(&mut g, 3, 1, 4, 3, 256 * 1024, b"");
    g.u8(7).u8(10).u8(0);
    // A request to a port nobody listens on, and a stray packet.
    vsock_packet(&mut g, 2, 0, 1, 0, 0, b"");
    vsock_packet(&mut g, 0, 0, 5, 0, 0, b"stray");
    // Host to guest: CONNECT 1024, the guest answers, data both ways.
    let mut h = TapeWriter::new();
    h.u8(7).u8(6).u8(6).u8(6);
    rx(&mut h);
    h.u8(8).bool(false).u8(0);
    h.u8(7).u8(15).u8(0);
    vsock_reply(&mut h, 0, 2, 0, b"");
    h.u8(7).u8(10).u8(0);
    h.u8(9).u8(0).blob(b"GET / ttrpc bytes");
    h.u8(7);
    rx(&mut h);
    vsock_reply(&mut h, 1, 2, 0, b"answer from the guest");
    vsock_reply(&mut h, 3, 2, 0, b"");
    h.u8(10).u8(0).u8(11).u8(0).u8(1).u8(7);
    rx(&mut h);
    vsock_reply(&mut h, 0, 0, 3, b"");
    // A host connection that writes garbage, and one the guest refuses.
    let mut bad = TapeWriter::new();
    bad.u8(1).u8(6).u8(6).u8(6);
    rx(&mut bad);
    bad.u8(8).bool(true).blob(b"CONNECT 99999999999999999999\n");
    bad.u8(8).bool(false).u8(1).u8(7).u8(15).u8(0);
    vsock_reply(&mut bad, 0, 1, 0, b"");
    bad.u8(8).bool(false).u8(2).u8(7);
    vec![g.finish(), h.finish(), bad.finish()]
}

/// One FUSE request (virtio_fs op 4): the opcode's index in the target's list, the node picked
/// from those learnt (0 = the root), raw arguments, and patches (byte offset, source: a handle
/// index, or a node index with the high bit).
fn fuse(w: &mut TapeWriter, opcode_index: u8, node: u8, args: &[u8], patches: &[(u8, u8)]) {
    w.u8(4).u8(opcode_index).u8(0).u8(node).blob(args);
    w.u8(patches.len() as u8);
    for &(at, src) in patches {
        w.u8(at).u8(src);
    }
}

fn le(fields: &[u64], widths: &[usize]) -> Vec<u8> {
    fields
        .iter()
        .zip(widths)
        .flat_map(|(v, &n)| v.to_le_bytes()[..n].to_vec())
        .collect()
}

fn with_name(mut args: Vec<u8>, names: &[&str]) -> Vec<u8> {
    for n in names {
        args.extend_from_slice(n.as_bytes());
        args.push(0);
    }
    args
}

/// Indices into the virtio_fs target's opcode list.
mod op {
    pub const LOOKUP: u8 = 0;
    pub const FORGET: u8 = 1;
    pub const GETATTR: u8 = 2;
    pub const SETATTR: u8 = 3;
    pub const READLINK: u8 = 4;
    pub const SYMLINK: u8 = 5;
    pub const MKNOD: u8 = 6;
    pub const MKDIR: u8 = 7;
    pub const UNLINK: u8 = 8;
    pub const RMDIR: u8 = 9;
    pub const RENAME: u8 = 10;
    pub const LINK: u8 = 11;
    pub const OPEN: u8 = 12;
    pub const READ: u8 = 13;
    pub const WRITE: u8 = 14;
    pub const STATFS: u8 = 15;
    pub const RELEASE: u8 = 16;
    pub const SETXATTR: u8 = 18;
    pub const OPENDIR: u8 = 24;
    pub const READDIR: u8 = 25;
    pub const ACCESS: u8 = 28;
    pub const CREATE: u8 = 29;
    pub const FALLOCATE: u8 = 34;
    pub const READDIRPLUS: u8 = 35;
    pub const RENAME2: u8 = 36;
    pub const LSEEK: u8 = 37;
    pub const COPY_FILE_RANGE: u8 = 38;
}

/// virtio_fs: a guest's session on the share: lookups, opens, reads and writes, creations of
/// every kind (some the policy refuses), renames, links, directory listings.
pub fn virtio_fs() -> Vec<Vec<u8>> {
    const O_RDWR: u64 = 2;
    const O_CREAT: u64 = 0o100;
    let mut w = TapeWriter::new();
    w.u8(6).u8(8).bool(false).u32(0);
    // nodes: [root, f, suid, new, sub, fifo, link]; handles: [f, suid, new, root dir]
    fuse(&mut w, op::LOOKUP, 0, &with_name(vec![], &["f"]), &[]);
    fuse(&mut w, op::LOOKUP, 0, &with_name(vec![], &["suid"]), &[]);
    fuse(&mut w, op::OPEN, 1, &le(&[O_RDWR, 0], &[4, 4]), &[]);
    fuse(
        &mut w,
        op::READ,
        1,
        &le(&[0, 0, 4096, 0, 0, 0, 0], &[8, 8, 4, 4, 8, 4, 4]),
        &[(0, 0)],
    );
    let mut write = le(&[0, 0, 5, 0, 0, 0, 0], &[8, 8, 4, 4, 8, 4, 4]);
    write.extend_from_slice(b"world");
    fuse(&mut w, op::WRITE, 1, &write, &[(0, 0)]);
    fuse(&mut w, op::OPEN, 2, &le(&[1, 0], &[4, 4]), &[]);
    fuse(&mut w, op::WRITE, 2, &write, &[(0, 1)]);
    let setattr_mode = le(
        &[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0o104755, 0, 0, 0, 0],
        &[4, 4, 8, 8, 8, 8, 8, 8, 4, 4, 4, 4, 4, 4, 4, 4],
    );
    fuse(&mut w, op::SETATTR, 1, &setattr_mode, &[]);
    let setattr_size = le(
        &[8, 0, 0, 1 << 20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        &[4, 4, 8, 8, 8, 8, 8, 8, 4, 4, 4, 4, 4, 4, 4, 4],
    );
    fuse(&mut w, op::SETATTR, 2, &setattr_size, &[]);
    fuse(
        &mut w,
        op::CREATE,
        0,
        &with_name(
            le(&[O_RDWR | O_CREAT, 0o100644, 0o022, 0], &[4, 4, 4, 4]),
            &["new"],
        ),
        &[],
    );
    fuse(
        &mut w,
        op::CREATE,
        0,
        &with_name(
            le(&[O_RDWR | O_CREAT, 0o104755, 0, 0], &[4, 4, 4, 4]),
            &["setuid"],
        ),
        &[],
    );
    fuse(
        &mut w,
        op::MKDIR,
        0,
        &with_name(le(&[0o2755, 0], &[4, 4]), &["sub"]),
        &[],
    );
    fuse(
        &mut w,
        op::MKNOD,
        0,
        &with_name(le(&[0o010644, 0, 0, 0], &[4, 4, 4, 4]), &["fifo"]),
        &[],
    );
    fuse(
        &mut w,
        op::MKNOD,
        0,
        &with_name(le(&[0o020600, 0x0101, 0, 0], &[4, 4, 4, 4]), &["mem"]),
        &[],
    );
    fuse(
        &mut w,
        op::MKNOD,
        0,
        &with_name(le(&[0o020000, 0, 0, 0], &[4, 4, 4, 4]), &["whiteout"]),
        &[],
    );
    fuse(
        &mut w,
        op::SYMLINK,
        0,
        &with_name(vec![], &["link", "../../../etc/shadow"]),
        &[],
    );
    fuse(&mut w, op::READLINK, 6, &[], &[]);
    fuse(
        &mut w,
        op::RENAME,
        0,
        &with_name(le(&[0], &[8]), &["f", "g"]),
        &[(0, 0x80)],
    );
    fuse(
        &mut w,
        op::RENAME2,
        0,
        &with_name(le(&[0, 2, 0], &[8, 4, 4]), &["g", "new"]),
        &[(0, 0x80)],
    );
    fuse(
        &mut w,
        op::LINK,
        0,
        &with_name(le(&[0], &[8]), &["hard"]),
        &[(0, 0x82)],
    );
    let mut xattr = le(&[20, 0], &[4, 4]);
    xattr.extend_from_slice(b"security.capability\0");
    xattr.extend_from_slice(&[
        1, 0, 0, 2, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]);
    fuse(&mut w, op::SETXATTR, 1, &xattr, &[]);
    fuse(&mut w, op::OPENDIR, 0, &le(&[0, 0], &[4, 4]), &[]);
    let read = le(&[0, 0, 4096, 0, 0, 0, 0], &[8, 8, 4, 4, 8, 4, 4]);
    fuse(&mut w, op::READDIR, 0, &read, &[(0, 3)]);
    fuse(&mut w, op::READDIRPLUS, 0, &read, &[(0, 3)]);
    fuse(
        &mut w,
        op::FALLOCATE,
        1,
        &le(&[0, 0, 1 << 16, 0, 0], &[8, 8, 8, 4, 4]),
        &[(0, 0)],
    );
    fuse(
        &mut w,
        op::LSEEK,
        1,
        &le(&[0, 1, 3, 0], &[8, 8, 4, 4]),
        &[(0, 0)],
    );
    fuse(
        &mut w,
        op::COPY_FILE_RANGE,
        1,
        &le(&[0, 0, 0, 0, 0, 10, 0], &[8; 7]),
        &[(0, 0), (16, 0x83), (24, 2)],
    );
    fuse(&mut w, op::STATFS, 0, &[], &[]);
    fuse(&mut w, op::ACCESS, 1, &le(&[4, 0], &[4, 4]), &[]);
    fuse(&mut w, op::GETATTR, 1, &le(&[0, 0, 0], &[4, 4, 8]), &[]);
    fuse(
        &mut w,
        op::RELEASE,
        1,
        &le(&[0, 0, 0, 0], &[8, 4, 4, 8]),
        &[(0, 0)],
    );
    fuse(&mut w, op::UNLINK, 0, &with_name(vec![], &["hard"]), &[]);
    fuse(&mut w, op::RMDIR, 0, &with_name(vec![], &["sub"]), &[]);
    fuse(&mut w, op::FORGET, 1, &le(&[1], &[8]), &[]);
    let session = w.finish();
    // The same without INIT first, and a few requests after a reset.
    let mut no_init = TapeWriter::new();
    no_init.u8(6).u8(8).bool(true);
    fuse(&mut no_init, op::LOOKUP, 0, &with_name(vec![], &["f"]), &[]);
    let mut reset = TapeWriter::new();
    reset.u8(6).u8(8).bool(false).u32(0);
    fuse(&mut reset, op::LOOKUP, 0, &with_name(vec![], &["d"]), &[]);
    reset.u8(7);
    fuse(&mut reset, op::LOOKUP, 0, &with_name(vec![], &["d"]), &[]);
    vec![session, no_init.finish(), reset.finish()]
}

/// cdi_spec: a JSON and a YAML spec with a device of its own nodes and spec-wide nodes.
pub fn cdi_spec() -> Vec<Vec<u8>> {
    let json = br#"{"cdiVersion":"0.6.0","kind":"vendor.com/gpu","devices":[{"name":"g0","containerEdits":{"deviceNodes":[{"path":"/dev/gpu0","hostPath":"/dev/nvidia0","permissions":"rw"}]}},{"name":"g1","containerEdits":{"deviceNodes":[{"path":"/dev/gpu1","permissions":"r"}]}}],"containerEdits":{"deviceNodes":[{"path":"/dev/gpuctl"}]}}"#;
    let yaml = b"cdiVersion: 0.6.0\nkind: vendor.com/disk\ndevices:\n  - name: d0\n    containerEdits:\n      deviceNodes:\n        - path: /dev/vdb\n          hostPath: /dev/loop3\n          permissions: rwm\ncontainerEdits:\n  env: [A=1]\n";
    let mut out = Vec::new();
    let mut w = TapeWriter::new();
    w.u8(0).blob(b"vendor.com/gpu=g0").blob(b"").bytes(json);
    out.push(w.finish());
    let mut w = TapeWriter::new();
    w.u8(1)
        .blob(b"vendor.com/disk=d0")
        .blob(br#"{"kind":"vendor.com/disk","devices":[{"name":"d0"}]}"#)
        .bytes(yaml);
    out.push(w.finish());
    out
}

/// pod_resources: a Get answer with a device plugin's devices and a DRA claim, and a List.
pub fn pod_resources() -> Vec<Vec<u8>> {
    use prost::Message;
    use shim::resources::devices::podresources::v1::*;
    let pod = PodResources {
        name: "p".into(),
        namespace: "n".into(),
        containers: vec![ContainerResources {
            name: "a".into(),
            devices: vec![ContainerDevices {
                resource_name: "example.com/disk".into(),
                device_ids: vec!["d0".into(), "d1".into(), "d0".into()],
                topology: None,
            }],
            dynamic_resources: vec![DynamicResource {
                claim_resources: vec![ClaimResource {
                    cdi_devices: vec![CdiDevice {
                        name: "vendor.com/gpu=g0".into(),
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }],
    };
    let get = GetPodResourcesResponse {
        pod_resources: Some(pod.clone()),
    };
    let list = ListPodResourcesResponse {
        pod_resources: vec![pod.clone(), PodResources::default(), pod],
    };
    let mut a = TapeWriter::new();
    a.bool(false).bytes(&get.encode_to_vec());
    let mut b = TapeWriter::new();
    b.bool(true).bytes(&list.encode_to_vec());
    vec![a.finish(), b.finish()]
}

/// oci_spec: an app container's spec as containerd writes it for a pod, a sandbox's, and a
/// CRI PodSandboxConfig.
pub fn oci_spec() -> Vec<Vec<u8>> {
    use prost::Message;
    let app = serde_json::json!({
        "ociVersion": "1.1.0",
        "process": {"user": {"uid": 0, "gid": 0}, "args": ["sh"], "cwd": "/"},
        "root": {"path": "rootfs", "readonly": false},
        "hooks": {"prestart": [{"path": "/bin/true"}]},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/data", "type": "bind", "source": "/var/lib/kubelet/pods/x/volumes/data", "options": ["rbind", "rslave", "ro"]},
            {"destination": "/etc/hosts", "source": "/var/lib/containerd/hosts", "options": ["bind"]}
        ],
        "annotations": {
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.sandbox-id": "pod1",
            "io.kubernetes.cri.sandbox-cpu-quota": "150000",
            "io.kubernetes.cri.sandbox-cpu-period": "100000",
            "io.kubernetes.cri.sandbox-memory": "268435456"
        },
        "linux": {
            "cgroupsPath": "/kubepods/pod1/c1",
            "namespaces": [
                {"type": "pid", "path": "/proc/42/ns/pid"},
                {"type": "network", "path": "/var/run/netns/cni-1"},
                {"type": "ipc", "path": "/proc/42/ns/ipc"},
                {"type": "mount"}
            ],
            "devices": [
                {"path": "/dev/null", "type": "c", "major": 1, "minor": 3},
                {"path": "/dev/vdb", "type": "b", "major": 7, "minor": 3},
                {"path": "/dev/vfio/12", "type": "c", "major": 243, "minor": 0}
            ],
            "resources": {"devices": [{"allow": false, "access": "rwm"}, {"allow": true, "type": "b", "major": 7, "minor": 3, "access": "rw"}]},
            "sysctl": {"net.ipv4.ip_forward": "1"}
        }
    });
    let sandbox = serde_json::json!({
        "annotations": {"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-id": "pod1"},
        "linux": {"namespaces": [{"type": "network"}, {"type": "pid"}, {"type": "uts"}]}
    });
    let mut out = Vec::new();
    for (cid, spec) in [("c1", app), ("pod1", sandbox)] {
        let mut w = TapeWriter::new();
        w.bool(false)
            .u8(cid.len() as u8)
            .bytes(cid.as_bytes())
            .u32(42);
        w.bytes(&serde_json::to_vec(&spec).expect("json"));
        out.push(w.finish());
    }
    let config = k8s_cri::v1::PodSandboxConfig {
        metadata: Some(k8s_cri::v1::PodSandboxMetadata {
            name: "p".into(),
            namespace: "n".into(),
            uid: "u".into(),
            attempt: 0,
        }),
        hostname: "p".into(),
        annotations: [("microvm.io/x".to_string(), "y".to_string())].into(),
        ..Default::default()
    };
    let mut w = TapeWriter::new();
    w.bool(true).u8(4).bytes(b"pod1").u32(1);
    w.bytes(&config.encode_to_vec());
    out.push(w.finish());
    out
}

/// boot_elf: a small 64-bit kernel with one loadable segment at 1 MiB and a PVH note.
pub fn boot_elf() -> Vec<Vec<u8>> {
    let mut f = vec![0u8; 0x2000];
    f[..4].copy_from_slice(b"\x7fELF");
    f[4] = 2;
    f[5] = 1;
    f[6] = 1;
    f[16..18].copy_from_slice(&2u16.to_le_bytes());
    f[18..20].copy_from_slice(&62u16.to_le_bytes());
    f[24..32].copy_from_slice(&0x10_0000u64.to_le_bytes());
    f[32..40].copy_from_slice(&64u64.to_le_bytes());
    f[52..54].copy_from_slice(&64u16.to_le_bytes());
    f[54..56].copy_from_slice(&56u16.to_le_bytes());
    f[56..58].copy_from_slice(&2u16.to_le_bytes());
    // PT_LOAD: offset 0x1000, paddr 1 MiB, 0x1000 bytes in the file, 0x3000 in memory.
    let ph =
        |f: &mut [u8], at: usize, p_type: u32, offset: u64, paddr: u64, filesz: u64, memsz: u64| {
            f[at..at + 4].copy_from_slice(&p_type.to_le_bytes());
            f[at + 8..at + 16].copy_from_slice(&offset.to_le_bytes());
            f[at + 16..at + 24].copy_from_slice(&paddr.to_le_bytes());
            f[at + 24..at + 32].copy_from_slice(&paddr.to_le_bytes());
            f[at + 32..at + 40].copy_from_slice(&filesz.to_le_bytes());
            f[at + 40..at + 48].copy_from_slice(&memsz.to_le_bytes());
        };
    ph(&mut f, 64, 1, 0x1000, 0x10_0000, 0x1000, 0x3000);
    ph(&mut f, 120, 4, 0x200, 0, 20, 20);
    // The Xen PVH note: namesz 4, descsz 4, type 18, "Xen\0", entry.
    f[0x200..0x204].copy_from_slice(&4u32.to_le_bytes());
    f[0x204..0x208].copy_from_slice(&4u32.to_le_bytes());
    f[0x208..0x20c].copy_from_slice(&18u32.to_le_bytes());
    f[0x20c..0x210].copy_from_slice(b"Xen\0");
    f[0x210..0x214].copy_from_slice(&0x10_0040u32.to_le_bytes());
    for (i, b) in f[0x1000..].iter_mut().enumerate() {
        *b = i as u8;
    }
    let mut unaligned = f.clone();
    // The same segment at an address that is not page-aligned with its file offset: copied.
    unaligned[64 + 16..64 + 24].copy_from_slice(&0x10_0800u64.to_le_bytes());
    unaligned[64 + 24..64 + 32].copy_from_slice(&0x10_0800u64.to_le_bytes());
    vec![f, unaligned]
}

/// One newc entry; every seed entry has inode 1 (the parser under test ignores it).
fn cpio_entry(out: &mut Vec<u8>, name: &str, mode: u32, data: &[u8]) {
    testkit::cpio::newc_entry(out, 1, mode, name, data);
}

/// initrd_cpio: two archives back to back, with a directory, files and a symlink.
pub fn initrd_cpio() -> Vec<Vec<u8>> {
    let mut a = Vec::new();
    cpio_entry(&mut a, "bin", 0o040755, b"");
    cpio_entry(&mut a, "bin/busybox", 0o100755, &[0x7f; 5000]);
    cpio_entry(&mut a, "init", 0o120777, b"bin/busybox");
    cpio_entry(&mut a, "etc/hostname", 0o100644, b"pod\n");
    cpio_entry(&mut a, "TRAILER!!!", 0, b"");
    let mut two = a.clone();
    two.extend_from_slice(&[0; 512]);
    cpio_entry(&mut two, "late", 0o100600, b"second archive");
    cpio_entry(&mut two, "TRAILER!!!", 0, b"");
    vec![a, two]
}

/// agent_handshake: good replies with ttrpc bytes after them, and garbage.
pub fn agent_handshake() -> Vec<Vec<u8>> {
    vec![
        b"OK 1073741824\n\x00\x00\x00\x10ttrpc".to_vec(),
        b"OK 1\n".to_vec(),
        b"OK \n".to_vec(),
        b"FAIL 3\n".to_vec(),
    ]
}

/// agent_forward: the agent's answers with stream bytes after them, and garbage.
pub fn agent_forward() -> Vec<Vec<u8>> {
    vec![
        b"ok\nHTTP/1.0 200 OK\r\n\r\nhello".to_vec(),
        b"error nothing accepts on port 8080\n".to_vec(),
        b"error \x1b[2J\n".to_vec(),
        b"OK\n".to_vec(),
        vec![b'x'; 300],
    ]
}

/// ready_line: the agent's line, and what else a guest may say.
pub fn ready_line() -> Vec<Vec<u8>> {
    vec![
        b"microvm-agent: ready (0.1.0)\n".to_vec(),
        b"microvm-agent: ready".to_vec(),
        b"\nmicrovm-agent: ready\n".to_vec(),
    ]
}

/// agent_reply: the agent's normal answer to each call, an error status, raw frames.
pub fn agent_reply() -> Vec<Vec<u8>> {
    use agent_protocol::agent as pb;
    use protobuf::Message;
    let check = pb::CheckResponse {
        agent_version: "0.1.0".into(),
        kernel_release: "6.12.0".into(),
        online_vcpus: 2,
        mem_total_kib: 262_144,
        boot_id: "8d3a".into(),
        ..Default::default()
    };
    let replies: Vec<(u8, Vec<u8>)> = vec![
        (0, check.write_to_bytes().expect("encode")),
        (
            1,
            pb::ListPidsResponse {
                pids: vec![1, 7, 9],
                ..Default::default()
            }
            .write_to_bytes()
            .expect("encode"),
        ),
        (
            2,
            pb::WaitProcessResponse {
                exit_status: 137,
                exited_at_unix_nanos: 1,
                ..Default::default()
            }
            .write_to_bytes()
            .expect("encode"),
        ),
        (
            3,
            pb::GetOomEventResponse {
                container_id: "c1".into(),
                ..Default::default()
            }
            .write_to_bytes()
            .expect("encode"),
        ),
        (
            4,
            pb::StatsResponse {
                cpu_usage_usec: 5,
                memory_usage_bytes: 1 << 20,
                ..Default::default()
            }
            .write_to_bytes()
            .expect("encode"),
        ),
        (
            5,
            pb::StartContainerResponse {
                pid: 12,
                ..Default::default()
            }
            .write_to_bytes()
            .expect("encode"),
        ),
        (
            6,
            pb::StartExecResponse {
                pid: 13,
                ..Default::default()
            }
            .write_to_bytes()
            .expect("encode"),
        ),
    ];
    let mut out = Vec::new();
    for (method, payload) in replies {
        let mut w = TapeWriter::new();
        w.u8(method).bool(false).u8(0).blob(b"").bytes(&payload);
        out.push(w.finish());
    }
    let mut err = TapeWriter::new();
    err.u8(3)
        .bool(false)
        .u8(4)
        .blob(b"deadline exceeded")
        .bytes(b"");
    out.push(err.finish());
    let mut raw = TapeWriter::new();
    raw.u8(0)
        .bool(true)
        .bytes(&[0, 0, 0, 2, 0, 0, 0, 1, 2, 0, 0x12, 0]);
    out.push(raw.finish());
    out
}

/// console_tail: a boot log's last lines.
pub fn console_tail() -> Vec<Vec<u8>> {
    let mut w = TapeWriter::new();
    w.u8(20).bytes(b"[    0.000000] Linux version 6.12\r\n[    0.1] virtio_mmio: probe\nmicrovm-agent: ready\n\x1b[31mred\x1b[0m\n");
    vec![w.finish()]
}
