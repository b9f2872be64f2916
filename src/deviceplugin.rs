//! The device-plugin front end: kubelet's gRPC APIs, registration, the
//! DevicePlugin service, and who holds which device (pod-resources). It
//! translates between kubelet's wire format and the layers below.

pub mod api;
pub mod authority;
pub mod checkpoint;
pub mod holders;
pub mod kubelet;
pub mod plugin;
pub mod podresources;
pub mod service;
