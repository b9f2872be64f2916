//! Clients that send the socket path as HTTP/2 `:authority`, as kubelet up to
//! 1.25 and grpc-go without an override do, reach the real plugin server.
//! tonic's client cannot send such an authority, so the test kit's raw HTTP/2
//! client does.

mod common;

use std::path::Path;

use common::{Node, WAIT};
use gpumem::deviceplugin::api::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateRequest, DevicePluginOptions,
    ListAndWatchResponse,
};
use gpumem::deviceplugin::service::plugin_options;
use gpumem::node::placement::Policy;
use gpumem::node::units::MemoryUnit;
use gpumem_testkit::h2c::{Authority, RawGrpc, Reply, FIRST_DYNAMIC};
use prost::Message;

const OPTIONS: &str = "/v1beta1.DevicePlugin/GetDevicePluginOptions";
const LIST_AND_WATCH: &str = "/v1beta1.DevicePlugin/ListAndWatch";
const ALLOCATE: &str = "/v1beta1.DevicePlugin/Allocate";

async fn connect(socket: &Path) -> RawGrpc {
    RawGrpc::connect(socket).await.unwrap()
}

/// One call, bounded: a server that never answers fails the test.
async fn call(
    client: &mut RawGrpc,
    path: &str,
    authority: Authority<'_>,
    message: &[u8],
) -> Result<Reply, String> {
    tokio::time::timeout(WAIT, client.call(path, authority, message))
        .await
        .expect("the server answers")
}

async fn plugin() -> Node {
    let node = Node::start("t4", MemoryUnit::GiB, Policy::Binpack).await;
    node.devices().await;
    node
}

/// GetDevicePluginOptions on a fresh connection, as kubelet's Register does.
async fn options(node: &Node, authority: &str) -> Result<DevicePluginOptions, String> {
    let mut client = connect(&node.socket()).await;
    let reply = call(&mut client, OPTIONS, Authority::Literal(authority), &[]).await?;
    assert_eq!(reply.grpc_status(), Some("0"), "{reply:?}");
    assert_eq!(reply.messages.len(), 1, "{reply:?}");
    Ok(DevicePluginOptions::decode(&reply.messages[0][..]).unwrap())
}

#[tokio::test]
async fn kubelet_1_25_sending_the_socket_path_gets_the_options() {
    let node = plugin().await;
    let path = node.socket().to_str().unwrap().to_owned();
    let served = options(&node, &path)
        .await
        .unwrap_or_else(|err| panic!(":authority {path}: {err}"));
    assert!(served.get_preferred_allocation_available);
    assert_eq!(served, plugin_options());
    node.stop().await;
}

#[tokio::test]
async fn encoded_forms_of_the_path_get_the_options() {
    let node = plugin().await;
    let path = node.socket().to_str().unwrap().to_owned();
    // Percent-encoded, as grpc-go encodes an authority; without the leading
    // slash, as a passthrough target's endpoint; both, as grpcio 1.85 sends.
    for authority in [
        path.replace('/', "%2F"),
        path[1..].to_owned(),
        path[1..].replace('/', "%2F"),
    ] {
        let served = options(&node, &authority)
            .await
            .unwrap_or_else(|err| panic!(":authority {authority}: {err}"));
        assert_eq!(served, plugin_options());
    }
    node.stop().await;
}

#[tokio::test]
async fn localhost_still_gets_the_options() {
    let node = plugin().await;
    assert_eq!(options(&node, "localhost").await.unwrap(), plugin_options());
    node.stop().await;
}

/// kubelet 1.25 keeps one connection and grpc-go's encoder indexes the
/// authority once, then refers to it: the rewrite must follow its table.
#[tokio::test]
async fn one_connection_like_kubelet_1_25_options_list_and_watch_allocate() {
    let node = plugin().await;
    let path = node.socket().to_str().unwrap().to_owned();
    let mut client = connect(&node.socket()).await;

    let reply = call(&mut client, OPTIONS, Authority::Indexed(&path), &[])
        .await
        .unwrap();
    assert_eq!(reply.grpc_status(), Some("0"), "{reply:?}");
    let served = DevicePluginOptions::decode(&reply.messages[0][..]).unwrap();
    assert_eq!(served, plugin_options());

    // The client's table: its first entry is the authority.
    let id = client
        .send(LIST_AND_WATCH, Authority::Table(FIRST_DYNAMIC), &[])
        .await
        .unwrap();
    let reply = tokio::time::timeout(WAIT, client.reply(id, true))
        .await
        .expect("the server answers")
        .unwrap();
    let first = ListAndWatchResponse::decode(&reply.messages[0][..]).unwrap();
    assert_eq!(first.devices.len(), 14, "a T4 in GiB");

    let request = AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: vec![first.devices[0].id.clone()],
        }],
    };
    let reply = call(
        &mut client,
        ALLOCATE,
        Authority::Table(FIRST_DYNAMIC),
        &request.encode_to_vec(),
    )
    .await
    .unwrap();
    assert_eq!(reply.grpc_status(), Some("0"), "{reply:?}");
    let allocated = AllocateResponse::decode(&reply.messages[0][..]).unwrap();
    assert_eq!(allocated.container_responses.len(), 1);
    assert_eq!(
        allocated.container_responses[0].envs["ALIYUN_COM_GPU_MEM_CONTAINER"],
        "1"
    );

    drop(client);
    node.stop().await;
}
