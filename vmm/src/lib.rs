//! Embeddable KVM microVM monitor.
